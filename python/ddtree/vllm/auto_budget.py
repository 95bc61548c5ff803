"""``ddtree_budget: "auto"``: each batch size's tree budget, chosen from measured step costs and live acceptance.

A bigger tree accepts more tokens per step but makes the step dearer, and how much dearer depends on the batch
size (a 65-token tree is nearly free beside one token at batch 1 on a large model, and not at batch 32) and on the
machine. ``auto`` picks, for every batch size ``n``, the candidate budget ``c`` with the most tokens per second::

    acceptance_length(c) / step_ms(c, n)

* **Candidates**: budgets of ``2^k - 1`` from the drafter's depth up to ``ddtree_max_budget`` (and that maximum), so
  that a tree and its root fill whole 16-row blocks of the tree kernels (:func:`auto_candidates`), each with FULL
  CUDA graphs of its trees at every captured batch size (``config.schedule_tree_graphs``).
* **Acceptance** (:class:`AcceptanceByBudget`): from the engine's own verified trees. A tree of a smaller budget
  is a prefix of a larger tree's pop order, so every tree says exactly what each candidate up to its own budget
  would have accepted (``what_if``). Counts decay window by window, so the estimate follows the traffic.
* **Step cost** (:class:`StepCosts`): the target's forward for ``n`` trees of each candidate, timed at start-up by
  replaying its FULL graph, plus the rest of the step, timed on live steps by the wall clock (:class:`StepTimer`,
  each step until the next one starts: everything the engine's loop spends on it): a part independent of
  the tree (drafter, commit, host gaps) and a part per verified token (logits, per-node sampling), the latter read
  from probes only (pooled, each weighted by its token spread, so larger batches set it):
  ``step_ms(c, n) = forward_ms(c, n) + rest_ms(c, n)``.
* **Probes, in turns**: a probe window runs the traffic's current budget and its neighbour candidate (the next
  larger one; the next smaller from the largest) in turns, a few steps each (:data:`PROBE_BLOCKS` blocks), and the
  per-token part is read from that window's steps alone. The neighbour, not the extremes: a probe of the smallest
  and the largest candidate ran budget 255 at 32 requests, and three such probes in a short run cost `auto` 40% of
  its batch-32 throughput on the test pair (`gpu-h200-pair-interleaved-f7bc6d2`). The host's speed
  drifts by tens of percent within minutes on a shared machine; read from step times of two budgets taken minutes
  apart, the per-token part was that drift (on the test pair, budget 127 at 4 requests 12.3 ms beyond its forward,
  at 3 requests 6.8: ``gpu-h200-pair-wallclock-18591c9``) and the lookup flapped.
* **Start**: every batch size at the largest candidate for the first window (like a fixed budget; its trees
  measure every candidate's acceptance at once), then the argmax, re-decided after every window. While no probe
  measured the per-token part in the traffic's octave (``[2^k, 2^(k+1))`` requests), a probe window is due. A
  batch size changes budget only for a gain above :data:`SWITCH_MARGIN` (no flapping between near-equal
  candidates).

The choice is one list indexed by batch size (:attr:`AutoBudget.lookup`). Under asynchronous scheduling vLLM's
scheduler reads the same list object (its dynamic speculative decoding lookup, ``patches`` 1b and 1c), so a choice
reaches the next step it schedules; synchronously the runner's proposer reads it. Either way a step's trees are
built at the size that was scheduled (late trees), so a change mid-flight costs one step counted as cut trees.
Pure numpy: CI tests the policy on CPU.

Its per-step part runs on the engine loop's path, so it is a few Python operations: a step's trees are buffered
(:meth:`AcceptanceByBudget.observe`) and counted in one numpy pass when the window is read, and a step's time is
appended to its (budget, trees) samples, the median taken when ``StepCosts.beyond`` is read; both give exactly what
folding step by step gave (``tests/vllm_adapter/test_auto_budget.py`` keeps that eager version as the oracle).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

#: ``ddtree_budget``'s value that asks for this policy.
AUTO = "auto"
#: The largest candidate when ``ddtree_max_budget`` is not given: the README's budget (budget 256 paid on the test
#: pair at batch 1 and 8, not at the Qwen3.6-27B shape's batch 8; a larger maximum also lowers how many requests a
#: step can hold, ``config.fit_batch_limits``). 63, not 64: see :func:`auto_candidates`.
DEFAULT_MAX_BUDGET = 63
#: Verify steps observed before each decision.
WINDOW_STEPS = 16
#: Trees a candidate needs (after decay) before its acceptance is trusted.
MIN_TREES = 32.0
#: The weight of the past at each window (the rest is the new window's).
KEEP = 0.75
#: A batch size leaves its budget only for a candidate at least this much faster.
SWITCH_MARGIN = 0.03
#: Windows between probes of one octave of batch sizes, and the most probes per octave (a probe: one window of the
#: current budget and its neighbour in turns, while no probe measured the per-token part in the traffic's octave).
PROBE_EVERY = 4
MAX_PROBES = 3
#: Turns of a probe window (neighbour, current, neighbour, current): a budget's steps sit between the other's, so
#: the host's drift falls on both alike.
PROBE_BLOCKS = 4
#: A probe's steps of one (budget, trees) needed before its median counts.
MIN_PROBE_SAMPLES = 2
#: Per-token slopes kept (the latest probes').
KEPT_SLOPES = 8
#: Live step times kept per (budget, trees): the rest of a step is their median, so a step that paid a kernel's
#: first compilation, a graph capture or an idle gap (tens of ms where steps take a few) moves nothing.
STEP_SAMPLES = 15
#: Tree counts whose forward is timed at start-up (the rest are interpolated).
TIMED_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Steps :class:`AcceptanceByBudget` buffers at most before counting them (a window is counted when it closes; this
#: bounds the buffer while no window closes, e.g. before vLLM's scheduler attached the lookup).
MAX_BUFFERED_STEPS = 64


def block_budgets(smallest: int, largest: int) -> List[int]:
    """Budgets ``2^k - 1`` (a tree and its root fill whole 16-row kernel blocks, :func:`auto_candidates`) within
    ``[smallest, largest]``, ascending."""
    return [b for b in ((1 << k) - 1 for k in range(1, largest.bit_length() + 1)) if smallest <= b <= largest]


def auto_candidates(draft_len: Optional[int], max_budget: int) -> Tuple[int, ...]:
    """Budgets of ``2^k - 1`` from the smallest that holds the drafter's depth (7 when unknown) up to
    ``max_budget``, and ``max_budget`` itself (the engine's ``B``), ascending.

    A tree of ``2^k - 1`` nodes and its root is ``2^k`` query tokens, whole 16-row blocks of the tree GDN and
    attention kernels; one node more opens a block for one row. On an H200 at the Qwen3.6-27B GDN shape a tree of
    64 tokens verifies in 54.7 us per layer against 69.6 us for 65 (200.8 against 254.4 at 8 trees; 16 tokens
    12.4 us against 26.1 for 17: ``benches/results/gpu-h200-gdn-blocks-768591a``), for one node's acceptance."""
    return tuple(sorted(set(block_budgets(max(7, draft_len or 0), max_budget)) | {max_budget}))


class StepCosts:
    """Milliseconds per verify step by candidate and batch size: the target's forward timed at start-up, the rest
    of the step on live steps.

    The rest (drafter, logits, per-node sampling, walk, commit, host gaps) has a part that grows with the tokens a
    step verifies (logits and sampling of ``n * (budget + 1)`` rows, outside the graphed forward) and a part that
    does not. Its per-token slope is read from probes (:meth:`close_probe`: steps of two budgets taken in turns);
    until one measured it, it counts as 0 (:meth:`needs_probe`: ``AutoBudget`` then runs a probe window).

    The timed forward is fixed once built (``forward`` is not to be changed afterwards): each step looks its
    (budget, trees) forward up in a cache.
    """

    def __init__(self, forward_ms: Mapping[int, Mapping[int, float]]):
        # budget -> sorted (trees, ms) of its timed FULL-graph replays
        self.forward = {int(b): sorted((int(n), float(ms)) for n, ms in by_n.items()) for b, by_n in forward_ms.items()}
        # (budget, trees) -> the last STEP_SAMPLES live steps' ms beyond the target's forward; their medians
        # (``beyond``, keys in the order first observed) are taken when read, for the keys stepped since (``_stale``).
        self._beyond: Dict[Tuple[int, int], float] = {}
        self._samples: Dict[Tuple[int, int], Deque[float]] = {}
        self._stale: Set[Tuple[int, int]] = set()
        # forward_ms by (budget, trees): the forward is fixed.
        self._forward_ms: Dict[Tuple[int, int], Optional[float]] = {}
        # The open probe's steps, (budget, trees) -> ms beyond the forward; and the slopes probes measured,
        # (trees, slope, weight), the latest KEPT_SLOPES.
        self._probe: Dict[Tuple[int, int], List[float]] = {}
        self.slopes: Deque[Tuple[int, float, float]] = deque(maxlen=KEPT_SLOPES)
        # The rest's model read from ``beyond``, ``(per-token slope, budget-independent part by trees, the measured
        # trees ascending)``: made once after each observation, not for every candidate and batch size a decision
        # asks about.
        self._model: Optional[Tuple[float, Dict[int, float], List[int]]] = None

    @property
    def beyond(self) -> Dict[Tuple[int, int], float]:
        """(budget, trees) -> ms of a live step beyond the target's forward: the median of its last
        :data:`STEP_SAMPLES` (taken here, for the keys observed since the last read)."""
        if self._stale:
            for key in self._stale:
                self._beyond[key] = float(np.median(self._samples[key]))
            self._stale.clear()
        return self._beyond

    def forward_ms(self, budget: int, trees: int) -> Optional[float]:
        """The forward of ``trees`` trees of ``budget``: interpolated between the timed counts, extrapolated
        linearly past the largest (per tree below the smallest); None when the budget was not timed."""
        key = (budget, trees)
        try:
            return self._forward_ms[key]
        except KeyError:
            pass
        row = self._interpolate(budget, np.array([trees], dtype=np.float64))
        ms = self._forward_ms[key] = None if row is None else float(row[0])
        return ms

    def observe_step(self, budget: int, trees: int, step_ms: float, probing: bool = False) -> None:
        """A live step of ``trees`` trees of ``budget`` took ``step_ms`` (:class:`StepTimer`); ``probing``: a step of
        the open probe (:meth:`close_probe`). Every step: a few Python operations (the median waits for a read)."""
        forward = self.forward_ms(budget, trees)
        if forward is None or not math.isfinite(step_ms) or step_ms <= 0:
            return
        beyond = max(step_ms - forward, 0.0)
        key = (budget, trees)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=STEP_SAMPLES)
            self._beyond[key] = beyond  # its place in ``beyond``'s order (the value is taken when read)
        samples.append(beyond)
        self._stale.add(key)
        if probing:
            probe = self._probe.get(key)
            if probe is None:
                self._probe[key] = [beyond]
            else:
                probe.append(beyond)
        self._model = None

    def close_probe(self) -> None:
        """The open probe's per-token slope at each batch size it timed at two budgets or more
        (:data:`MIN_PROBE_SAMPLES` steps each; least squares on the medians), kept with its token spread as weight."""
        by_trees: Dict[int, List[Tuple[int, float]]] = {}
        for (budget, trees), samples in self._probe.items():
            if len(samples) >= MIN_PROBE_SAMPLES:
                by_trees.setdefault(trees, []).append((budget, float(np.median(samples))))
        self._probe = {}
        for trees, points in sorted(by_trees.items()):
            if len(points) < 2:
                continue
            x = np.array([trees * (budget + 1) for budget, _ in points], dtype=np.float64)
            y = np.array([ms for _, ms in points], dtype=np.float64)
            spread = float(((x - x.mean()) ** 2).sum())
            if spread <= 0:  # no tokens between its budgets (steps of 0 trees): nothing to read a slope from
                continue
            self.slopes.append((trees, float(((x - x.mean()) * (y - y.mean())).sum()) / spread, spread))
        self._model = None

    def _by_trees(self) -> Dict[int, List[Tuple[int, float]]]:
        by_trees: Dict[int, List[Tuple[int, float]]] = {}
        for (budget, trees), ms in self.beyond.items():
            by_trees.setdefault(trees, []).append((budget, ms))
        return by_trees

    def per_token_ms(self) -> float:
        """The rest's slope against the verified tokens ``n * (budget + 1)``: the probes' slopes averaged by their
        token spread (0 when no probe measured one; never below 0)."""
        return self._rest_model()[0]

    def _rest_model(self) -> Tuple[float, Dict[int, float], List[int]]:
        if self._model is None:
            slope = self._slope()
            fixed = {
                trees: max(0.0, float(np.mean([ms - slope * trees * (b + 1) for b, ms in points])))
                for trees, points in self._by_trees().items()
            }
            self._model = (slope, fixed, sorted(fixed))
        return self._model

    def _slope(self) -> float:
        # Pooled least squares (one intercept per probe and batch size): a slope weighs by its token spread, so 8
        # trees timed at two budgets outweigh 1 tree (8x the tokens between the same two budgets).
        if not self.slopes:
            return 0.0
        slopes, weights = zip(*((slope, weight) for _, slope, weight in self.slopes))
        return max(0.0, float(np.average(slopes, weights=weights)))

    def needs_probe(self, trees: int) -> bool:
        """Live steps were timed, but no probe measured the per-token part in ``trees``' octave
        (``[2^k, 2^(k+1))``): read from far smaller or larger batches only (a slope read at 1 tree, ~0.2 ms between
        budgets 16 and 256, is mostly noise at the scale of a host-bound step), it would decide there."""
        if not self.beyond:
            return False
        return all(n.bit_length() != int(trees).bit_length() for n, _, _ in self.slopes)

    def rest_ms(self, budget: int, trees: int) -> float:
        """The rest of a step of ``trees`` trees of ``budget``: its budget-independent part measured at this batch
        size (else at the nearest measured one, else 0), plus the per-token part."""
        slope = self._rest_model()[0]
        return float(self._fixed_row(np.array([trees], dtype=np.float64))[0]) + slope * trees * (budget + 1)

    def step_ms(self, budget: int, trees: int) -> Optional[float]:
        step = self.step_ms_table([budget], np.array([trees]))[0, 0]
        return None if np.isnan(step) else float(step)

    def step_ms_table(self, budgets: Sequence[int], trees: np.ndarray) -> np.ndarray:
        """:meth:`step_ms` for every budget and tree count at once, ``[len(budgets), len(trees)]`` (NaN where a
        budget was not timed): a decision asks about every batch size up to ``max_num_seqs``."""
        trees = np.asarray(trees, dtype=np.float64)
        slope = self._rest_model()[0]
        rest = self._fixed_row(trees)
        table = np.full((len(budgets), trees.shape[0]), np.nan)
        for row, budget in enumerate(budgets):
            forward = self._interpolate(budget, trees)
            if forward is not None:
                table[row] = forward + rest + slope * trees * (budget + 1)
        return table

    def _fixed_row(self, trees: np.ndarray) -> np.ndarray:
        """The rest's budget-independent part for each tree count: that of the nearest measured batch size (the
        smaller on a tie), 0 while none was measured."""
        _, fixed, measured = self._rest_model()
        if not measured:
            return np.zeros_like(trees)
        known = np.asarray(measured, dtype=np.float64)
        i = np.searchsorted(known, trees, side="left")
        below, above = np.clip(i - 1, 0, None), np.minimum(i, known.shape[0] - 1)
        closer_below = np.abs(known[below] - trees) <= np.abs(known[above] - trees)
        return np.array([fixed[n] for n in measured])[np.where(closer_below, below, above)]

    def _interpolate(self, budget: int, trees: np.ndarray) -> Optional[np.ndarray]:
        """:meth:`forward_ms` over an array of tree counts (the same interpolation, the same arithmetic)."""
        points = self.forward.get(budget)
        if not points:
            return None
        counts = np.array([n for n, _ in points], dtype=np.float64)
        ms = np.array([m for _, m in points], dtype=np.float64)
        if counts.shape[0] == 1:
            return ms[0] * trees / counts[0]
        i = np.searchsorted(counts, trees, side="left")
        upper = np.clip(i, 1, counts.shape[0] - 1)  # the segment [upper - 1, upper]; past the ends, the end one
        n0, n1, m0, m1 = counts[upper - 1], counts[upper], ms[upper - 1], ms[upper]
        out = m0 + (m1 - m0) * (trees - n0) / (n1 - n0)
        out = np.where(i == 0, ms[0] * trees / counts[0], out)  # below the smallest count: per tree
        exact = (i < counts.shape[0]) & (counts[np.minimum(i, counts.shape[0] - 1)] == trees)
        return np.where(exact, ms[np.minimum(i, counts.shape[0] - 1)], out)


class AcceptanceByBudget:
    """Each candidate's acceptance length on the engine's trees, counted exactly from larger or equal trees and
    decayed window by window.

    A candidate is estimated as the smallest candidate's acceptance (every tree says what it keeps) plus, candidate
    by candidate, what the next larger one keeps beyond the one below on the trees that say both: budgets compared on
    the same trees. Estimated from each candidate's own trees alone, a budget not run lately kept an old window's
    figure while the running one followed the traffic (on the test pair at batch 32, ``auto`` took budget 15 at 3.39
    against budget 63 frozen at 3.61, where a fixed budget 63 accepted 3.96 in the same run:
    ``gpu-h200-pair-launch-ahead-632c917``). On trees that say every candidate, both estimates are the same.

    A step's trees are buffered (:meth:`observe`: copies, a few microseconds) and counted in one numpy pass when the
    window is read (:meth:`close_window`, ``_window_*``) or :data:`MAX_BUFFERED_STEPS` wait: the counts are integers,
    summed exactly in any order, so this is what counting step by step gave, bit for bit.
    """

    def __init__(self, candidates: Sequence[int], keep: float = KEEP):
        self.candidates = np.asarray(sorted(candidates), dtype=np.int64)
        self.keep = keep
        self.trees = np.zeros(self.candidates.shape[0])
        self.kept = np.zeros(self.candidates.shape[0])
        # [0]: what the smallest candidate keeps; [k]: what candidate k keeps beyond candidate k - 1 (same trees).
        self.gains = np.zeros(self.candidates.shape[0])
        # The window's counts so far (trees, kept, gains by candidate) and the steps not counted yet, each
        # (budgets [R], whole [R], drafts [R, P], accepted [R]).
        self._counted = np.zeros((3, self.candidates.shape[0]))
        self._buffered: List[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def observe(self, budgets: np.ndarray, whole: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """One step's trees: ``budgets`` ``[R]`` each tree's budget, ``whole`` ``[R]`` whether it is the drafter's
        whole tree (not cut, not a filler), ``drafts`` ``[R, P]`` the accepted path's draft numbers in pop order
        (1-based, from depth 1), ``accepted`` ``[R]`` how many of them count. Copied (``drafts`` may be a view of a
        reused buffer) and counted later, with the window's other steps."""
        budgets = np.array(budgets)
        whole = np.array(whole, dtype=bool)
        drafts = np.array(drafts, dtype=np.int64)
        accepted = np.array(accepted, dtype=np.int64)
        rows = drafts.shape[0] if drafts.ndim == 2 else -1
        if budgets.shape != (rows,) or whole.shape != (rows,) or accepted.shape != (rows,):
            raise ValueError(
                f"a step's trees: budgets {budgets.shape}, whole {whole.shape}, accepted {accepted.shape} must be "
                f"[R] and drafts {drafts.shape} [R, P]"
            )
        self._buffered.append((budgets, whole, drafts, accepted))
        if len(self._buffered) >= MAX_BUFFERED_STEPS:
            self._count()

    def _count(self) -> None:
        """Counts the buffered steps into the window, all in one pass (when steps differ in ``P``, a step's drafts
        padded to the widest step's with a draft number no candidate keeps)."""
        steps, self._buffered = self._buffered, []
        if not steps:
            return
        if len(steps) == 1:
            budgets, whole, drafts, accepted = steps[0]
        else:
            budgets = np.concatenate([step[0] for step in steps])
            whole = np.concatenate([step[1] for step in steps])
            accepted = np.concatenate([step[3] for step in steps])
            widths = {step[2].shape[1] for step in steps}
            if len(widths) == 1:
                drafts = np.concatenate([step[2] for step in steps])
            else:
                drafts = np.full((budgets.shape[0], max(widths)), self.candidates[-1] + 1, dtype=np.int64)
                row = 0
                for _, _, step_drafts, _ in steps:
                    drafts[row : row + step_drafts.shape[0], : step_drafts.shape[1]] = step_drafts
                    row += step_drafts.shape[0]
        on_path = np.arange(drafts.shape[1])[None, :] < accepted[:, None]
        caps = self.candidates[:, None]
        counted = whole[None, :] & (budgets[None, :] >= caps)  # [C, R]
        kept = ((drafts[None, :, :] <= caps[:, :, None]) & on_path[None, :, :]).sum(axis=2)  # [C, R]
        beyond = kept.copy()  # [C, R]: kept by candidate k beyond candidate k - 1
        beyond[1:] -= kept[:-1]
        self._counted += np.stack([counted.sum(axis=1), (counted * kept).sum(axis=1), (counted * beyond).sum(axis=1)])

    @property
    def _window_trees(self) -> np.ndarray:
        """The window's trees by candidate (``_window_kept``, ``_window_gains``: what they keep), buffered steps
        counted."""
        self._count()
        return self._counted[0]

    @property
    def _window_kept(self) -> np.ndarray:
        self._count()
        return self._counted[1]

    @property
    def _window_gains(self) -> np.ndarray:
        self._count()
        return self._counted[2]

    def close_window(self) -> None:
        """Folds the window into the estimate: the past decays only for candidates the window observed."""
        self._count()
        window_trees, window_kept, window_gains = self._counted
        seen = window_trees > 0
        self.trees[seen] = self.keep * self.trees[seen] + window_trees[seen]
        self.kept[seen] = self.keep * self.kept[seen] + window_kept[seen]
        self.gains[seen] = self.keep * self.gains[seen] + window_gains[seen]
        self._counted[:] = 0

    def acceptance_length(self, min_trees: float = MIN_TREES) -> Dict[int, float]:
        """Candidates with enough trees (they and every smaller candidate) -> mean acceptance length (bonus token
        included), built up from the smallest candidate by gains on common trees."""
        out: Dict[int, float] = {}
        length = 1.0
        for c, trees, gain in zip(self.candidates, self.trees, self.gains):
            if trees < min_trees:
                break
            length += gain / trees
            out[int(c)] = length
        return out


class AutoBudget:
    """The live budget of every batch size (``lookup[n]``, ``n`` from 1 to ``max_num_seqs``)."""

    def __init__(
        self,
        candidates: Sequence[int],
        max_num_seqs: int,
        window_steps: int = WINDOW_STEPS,
        min_trees: float = MIN_TREES,
        margin: float = SWITCH_MARGIN,
    ):
        if not candidates:
            raise ValueError("auto budget needs at least one candidate")
        self.candidates = tuple(sorted(candidates))
        self.largest = self.candidates[-1]
        # Index 0 too: vLLM's scheduler indexes its lookup by the batch size, from 0 (``build_dynamic_sd_schedule_lookup``).
        self.lookup: List[int] = [self.largest] * (max_num_seqs + 1)
        self.acceptance = AcceptanceByBudget(self.candidates)
        self.costs: Optional[StepCosts] = None
        self.window_steps, self.min_trees, self.margin = window_steps, min_trees, margin
        self._steps_in_window = 0
        self.decisions = 0
        self.changes = 0
        # Under asynchronous scheduling vLLM's scheduler places each step's drafts: the lookup may change only once
        # the scheduler reads this very list (``attach_scheduler``); synchronously the runner's proposals decide.
        self.needs_scheduler = False
        self.attached = False
        # A probe window runs two budgets in turns everywhere (``_probe_pair``: the first is run first); the lookup
        # it replaced is the one the next decision keeps or leaves (its hysteresis). Probes are counted per octave
        # of the batch size the traffic had.
        self.probes = 0
        self._probe_steps = 0
        self._probe_pair: Tuple[int, int] = (self.candidates[0], self.largest)
        self._probes_by_octave: Dict[int, Tuple[int, int]] = {}  # octave -> (probes, decision of the last)
        self._before_probe: Optional[List[int]] = None
        self._window_batch_sizes: Dict[int, int] = {}  # trees per observed step -> steps, this window
        # The step timer's latest periods (``StepTimer.trace``, which the runner hands over), for the summary.
        self.period_trace: Sequence[Tuple[int, int, float, bool]] = ()

    @property
    def probing(self) -> bool:
        return self._before_probe is not None

    def budget_for(self, num_requests: int) -> int:
        return self.lookup[min(max(num_requests, 0), len(self.lookup) - 1)]

    def set_forward_costs(self, forward_ms: Mapping[int, Mapping[int, float]]) -> None:
        self.costs = StepCosts(forward_ms)

    def observe(self, budgets, whole, drafts, accepted) -> None:
        """One observed verify step (see :meth:`AcceptanceByBudget.observe`); in a probe, every block of steps
        hands the lookup to the probe's other budget."""
        self.acceptance.observe(budgets, whole, drafts, accepted)
        self._steps_in_window += 1
        trees = len(budgets)
        self._window_batch_sizes[trees] = self._window_batch_sizes.get(trees, 0) + 1
        if self.probing:
            self._probe_steps += 1
            if self._probe_steps % self._probe_block == 0:
                first, second = self._probe_pair
                self.lookup[1:] = [second if self.lookup[1] == first else first] * (len(self.lookup) - 1)

    @property
    def _probe_block(self) -> int:
        return max(1, self.window_steps // PROBE_BLOCKS)

    def observe_step_time(self, budget: int, trees: int, step_ms: float) -> None:
        if self.costs is not None:
            self.costs.observe_step(budget, trees, step_ms, probing=self.probing)

    def maybe_decide(self) -> Optional[bool]:
        """After a full window: folds it in and re-decides every batch size. None: no decision this step; else
        whether the lookup changed."""
        if self._steps_in_window < self.window_steps or (self.needs_scheduler and not self.attached):
            return None
        self._steps_in_window = 0
        self.acceptance.close_window()
        self.decisions += 1
        before = list(self.lookup)
        if self.probing and self.costs is not None:
            self.costs.close_probe()
        self.decide()
        typical, self._window_batch_sizes = self._typical_batch_size(), {}
        if self._probe_due(typical):
            self._before_probe = list(self.lookup)
            self._probe_pair = self._neighbours(self.budget_for(typical))
            self.lookup[1:] = [self._probe_pair[0]] * (len(self.lookup) - 1)
            self._probe_steps = 0
            self.probes += 1
            octave = typical.bit_length()
            self._probes_by_octave[octave] = (self._probes_by_octave.get(octave, (0, 0))[0] + 1, self.decisions)
        changed = self.lookup != before
        self.changes += int(changed)
        return changed

    def _typical_batch_size(self) -> int:
        """The trees per step the window saw most often (the larger on a tie; 1 when it saw none)."""
        if not self._window_batch_sizes:
            return 1
        return max(self._window_batch_sizes, key=lambda n: (self._window_batch_sizes[n], n))

    def _neighbours(self, budget: int) -> Tuple[int, int]:
        """``(neighbour, budget)``: the candidate next above ``budget`` (next below from the largest) and itself."""
        i = self.candidates.index(budget)
        return (self.candidates[i + 1] if i + 1 < len(self.candidates) else self.candidates[i - 1]), budget

    def _probe_due(self, trees: int) -> bool:
        """A probe is due when no probe measured the per-token part in the octave of the window's batch size
        (``StepCosts.needs_probe``): at most :data:`MAX_PROBES` times per octave, :data:`PROBE_EVERY` windows
        apart, the first at the first decision that sees that octave."""
        if self.costs is None or len(self.candidates) < 2 or not self.costs.needs_probe(trees):
            return False
        done, last = self._probes_by_octave.get(trees.bit_length(), (0, 0))
        return done < MAX_PROBES and (done == 0 or self.decisions >= last + PROBE_EVERY)

    def decide(self) -> None:
        """Re-decides every batch size in place (the list object is shared with vLLM's scheduler); after a probe,
        from the lookup the probe replaced."""
        current, self._before_probe = self._before_probe or list(self.lookup), None
        tau = self.acceptance.acceptance_length(self.min_trees)
        if self.costs is not None and tau and len(current) > 1:  # else (no costs, no trusted acceptance): as it was
            current[1:] = self._best(tau, np.asarray(current[1:], dtype=np.int64)).tolist()
        self.lookup[:] = current

    def _best(self, tau: Mapping[int, float], current: np.ndarray) -> np.ndarray:
        """Each batch size's candidate with the most accepted tokens per ms (the smaller on a tie); a batch size keeps
        ``current`` unless the best beats it by more than the margin, or while its own budget is not measured enough
        (no trusted acceptance, no timed forward): then there is nothing to compare with."""
        candidates = np.asarray(self.candidates, dtype=np.int64)
        trees = np.arange(1, current.shape[0] + 1)
        steps = self.costs.step_ms_table(self.candidates, trees)
        accepted = np.array([tau.get(int(c), np.nan) for c in candidates])[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = np.where(np.isfinite(steps) & (steps > 0), accepted / steps, np.nan)
        rates = np.where(np.isnan(rates), -np.inf, rates)
        columns = np.arange(trees.shape[0])
        at = np.searchsorted(candidates, current).clip(0, candidates.shape[0] - 1)
        current_rate = np.where(candidates[at] == current, rates[at, columns], -np.inf)
        best = rates.argmax(axis=0)  # the first maximum: the smallest candidate among equals
        move = np.isfinite(current_rate) & (rates[best, columns] > current_rate * (1 + self.margin))
        return np.where(move, candidates[best], current)

    def describe(self) -> str:
        """The lookup as ranges, ``1-4: 64, 5-32: 16``, and what it rests on."""
        ranges, start = [], 1
        for n in range(2, len(self.lookup) + 1):
            if n == len(self.lookup) or self.lookup[n] != self.lookup[start]:
                last = n - 1
                ranges.append(
                    f"{start}-{last}: {self.lookup[start]}" if last > start else f"{start}: {self.lookup[start]}"
                )
                start = n
        tau = self.acceptance.acceptance_length(self.min_trees)
        accept = ", ".join(f"{c}: {t:.2f}" for c, t in sorted(tau.items()))
        probe = (
            f"probing budgets {self._probe_pair[0]} and {self._probe_pair[1]} in turns for one window (the per-token part "
            "not measured at this batch size); "
            if self.probing
            else ""
        )
        return (
            f"{probe}budget by batch size {', '.join(ranges)} (acceptance length by budget {accept or 'not yet known'})"
        )

    def summary(self) -> Dict[str, object]:
        costs = self.costs
        return {
            "candidates": list(self.candidates),
            "lookup": self.describe(),
            "decisions": self.decisions,
            "changes": self.changes,
            "acceptance_length": self.acceptance.acceptance_length(self.min_trees),
            "forward_ms": {b: dict(points) for b, points in costs.forward.items()} if costs else {},
            "probes": self.probes,
            "per_token_ms": costs.per_token_ms() if costs else 0.0,
            # What it rests on: each probe's slope at a batch size, (trees, ms per token, token spread).
            "probe_slopes": [list(entry) for entry in costs.slopes] if costs else [],
            "beyond_forward_ms": {f"{b}x{n}": ms for (b, n), ms in sorted(costs.beyond.items())} if costs else {},
            # How many live steps each median above rests on (a median of one or two is that step's own time).
            "beyond_forward_samples": {f"{b}x{n}": len(q) for (b, n), q in sorted(costs._samples.items())}
            if costs
            else {},
            # The latest step periods, kept or not, oldest first: (budget, trees, ms, kept).
            "step_periods": [list(period) for period in self.period_trace],
        }


class StepTimer:
    """Wall-clock milliseconds of live verify steps, each from its ``execute_model`` to the next one's: what a step
    costs the engine's loop (vLLM's scheduling and bookkeeping, ddtree's host work, and the GPU wherever the host
    waits for it), i.e. the reciprocal of the steps per second the traffic gets.

    Why not the GPU's span: timed with CUDA events from ``execute_model`` to the drafter's launches, budget 127 at
    8 requests on the test pair measured 9.4 ms beyond its forward where the engine ran 18.2 ms per step, and
    ``auto`` kept it over budget 63 (10.2 ms per step at 8 requests, 1.86x the chain against 1.10x;
    ``gpu-h200-pair-auto-2b70899``): what a bigger tree costs outside that span (host work that scales with the
    scheduled drafts) never reached the choice.

    A step's period is kept only inside a run of one key (budget, trees): the steps before and after it timed and
    of that key. Both neighbours' work can sit in a period: it holds the next step's scheduling, which runs before
    that step's ``execute_model``, and its own plan waits for the step before it to finish drafting on the GPU, so
    under asynchronous scheduling the first period of a new budget is largely the old budget's GPU work. Checked
    against the next step only, a probe's blocks (four steps each) gave each budget some of the other's time, the
    likely cause of what ``gpu-h200-pair-7c51655`` showed: budget 63 at 32 requests read 14.0 ms beyond its
    forward and 255 read 10.8 where fixed engines ran whole steps of 16.4 (63) and 23.8 ms (127), and every probe's
    per-token slope came out negative (clipped to 0). A step beside a prefill, an idle gap or a step that captured a
    graph is dropped the same way.

    :attr:`trace` keeps the latest periods, kept or not (``(budget, trees, ms, kept)``; ``auto``'s summary shows
    them), so a record can show what the choice rested on.
    """

    #: Periods :attr:`trace` keeps.
    TRACE = 256

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._started: Optional[float] = None  # this step's start
        # The last timed step until the next starts: (key, start, whether the step before it had its key).
        self._waiting: Optional[Tuple[object, float, bool]] = None
        self._measured: Optional[Tuple[object, float, bool]] = None  # that step's (key, ms, ...) once the next starts
        self._previous: object = None  # the key of the step finished last (None: not timed)
        self._landed: List[Tuple[object, float]] = []
        self.trace: Deque[Tuple[int, int, float, bool]] = deque(maxlen=self.TRACE)

    def start(self) -> None:
        """A step starts (again, if the last one never finished: a step that sampled nothing)."""
        now = self._clock()
        if self._waiting is not None:
            key, started, after_same = self._waiting
            self._measured, self._waiting = (key, 1e3 * (now - started), after_same), None
        self._started = now

    def finish(self, key) -> None:
        """Ends the step started last; ``key`` names it (None: not a step worth timing; the steps beside it are then
        dropped too)."""
        measured, self._measured = self._measured, None
        previous, self._previous = self._previous, key
        if measured is not None:
            kept = measured[0] == key and measured[2]
            if kept:
                self._landed.append(measured[:2])
            self.trace.append((*measured[0], round(measured[1], 3), kept))
        if key is None or self._started is None:
            self._waiting, self._previous = None, None
            return
        self._waiting, self._started = (key, self._started, previous == key), None

    def landed(self) -> List[Tuple[object, float]]:
        """``(key, ms)`` of the steps timed since the last call, oldest first."""
        out, self._landed = self._landed, []
        return out


def timed_counts(graphed: Sequence[int]) -> List[int]:
    """Of a budget's graphed tree counts, those timed at start-up: :data:`TIMED_COUNTS` and the largest."""
    graphed = sorted(set(graphed))
    if not graphed:
        return []
    return sorted({n for n in graphed if n in TIMED_COUNTS} | {graphed[-1]})


def forward_table(timings: Mapping[Tuple[int, int], float]) -> Dict[int, Dict[int, float]]:
    """``{(budget, trees): ms}`` as ``{budget: {trees: ms}}``."""
    table: Dict[int, Dict[int, float]] = {}
    for (budget, trees), ms in timings.items():
        table.setdefault(budget, {})[trees] = ms
    return table


# ---- the live lookup shared with vLLM's scheduler (``patches`` 1c) -----------------------------------------------
#: The AutoBudget a runner of this process published for the scheduler built after it (at most one waits).
_PUBLISHED: List[AutoBudget] = []


def publish(auto: AutoBudget) -> None:
    """A runner offers its live lookup to the scheduler its engine builds next in this process."""
    _PUBLISHED[:] = [auto]


def attach_scheduler(scheduler) -> bool:
    """Hands the published lookup to ``scheduler`` (its ``dynamic_sd_lookup`` becomes the same list object); False
    when no runner of this process published one of the same length (the runner then keeps the largest budget)."""
    auto = _PUBLISHED.pop() if _PUBLISHED else None
    if auto is None or len(auto.lookup) != len(scheduler.dynamic_sd_lookup):
        return False
    scheduler.dynamic_sd_lookup = auto.lookup
    auto.attached = True
    return True
