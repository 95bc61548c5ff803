"""``ddtree_budget: "auto"``: each batch size's tree budget, chosen from live acceptance and step periods measured
in turns.

A bigger tree accepts more tokens per step but makes the step dearer, and how much dearer depends on the batch
size (a 65-token tree is nearly free beside one token at batch 1 on a large model, and not at batch 32), on the
machine, and on whether the step waits for the GPU or for the host. ``auto`` keeps one budget per octave of batch
sizes (``[2^k, 2^(k+1))`` requests) and moves it to a neighbouring candidate ``c`` when that gives more tokens per
second::

    acceptance_length(c) / step_period(c)

* **Candidates**: budgets of ``2^k - 1`` from the drafter's depth up to ``ddtree_max_budget`` (and that maximum), so
  that a tree and its root fill whole 16-row blocks of the tree kernels (:func:`auto_candidates`), each with FULL
  CUDA graphs of its trees at every captured batch size (``config.schedule_tree_graphs``).
* **Acceptance** (:class:`AcceptanceByBudget`): from the engine's own verified trees. A tree of a smaller budget
  is a prefix of a larger tree's pop order, so every tree says exactly what each candidate up to its own budget
  would have accepted (``what_if``). Counts decay window by window, so the estimate follows the traffic.
* **Step periods, relative, in turns** (:class:`ProbedRatios`): a probe window runs the octave's budget and a
  neighbouring candidate in turns (:data:`PROBE_BLOCKS` blocks of a few steps), and each step's wall-clock period
  (:class:`StepTimer`: ``execute_model`` to the next one's, kept only inside a run of one budget and batch size)
  is compared with the other budget's at the same batch size: the ratio of their medians, per octave. Only the
  ratio is used, never a period taken at another time: the host's speed drifts by tens of percent within minutes on
  a shared machine (on the test pair, budget 127 at 4 requests 12.3 ms beyond its forward, at 3 requests 6.8:
  ``gpu-h200-pair-wallclock-18591c9``), and steps of two budgets taken in turns share that drift.
* **Why no model of the step**: until ``gpu-h200-pair-cad0d30`` the step was modelled as the target's forward
  (timed at start-up by replaying its FULL graph) plus a rest fitted to live periods. Under asynchronous scheduling
  the forward overlaps the host's work, so the sum is wrong where the host bounds the step: on the test pair at one
  request budget 127's forward was 0.52 ms dearer than 63's, its measured period was not, and the model kept 63
  where a fixed 127 ran 1.34x the chain against 63's 1.22x. Per-batch-size decisions on a handful of periods also
  split the batch sizes into runs of alternating budgets (``1: 63, 2-6: 127, 7-31: 63, 32: 127``), every one of
  them a step shape whose graphs are captured on first use.
* **Hill climbing**: every octave starts at the largest candidate (like a fixed budget; its trees measure every
  candidate's acceptance at once). While a neighbour of an octave's budget has no measured ratio in that octave
  (the next larger first, then the next smaller), a probe is due when the traffic is in that octave (half a
  window's steps or more at one batch size of it, or :data:`SETTLE_STEPS` steps in a row there, which opens it at
  once): at most :data:`MAX_PROBES` per octave, :data:`PROBE_EVERY`
  windows apart. Budgets linked by measured ratios are compared every window, and the octave moves to the best
  only for a gain above :data:`SWITCH_MARGIN`; a move opens the new budget's other neighbour to a probe. An octave no probe has measured takes the budget of the nearest measured
  octave (the one above on a tie), so batch sizes the traffic passes through briefly (a batch's tail, a ramp up)
  share the budget of the batch sizes next to them instead of keeping the largest.

The choice is one list indexed by batch size (:attr:`AutoBudget.lookup`). Under asynchronous scheduling vLLM's
scheduler reads the same list object (its dynamic speculative decoding lookup, ``patches`` 1b and 1c), so a choice
reaches the next step it schedules; synchronously the runner's proposer reads it. Either way a step's trees are
built at the size that was scheduled (late trees), so a change mid-flight costs one step counted as cut trees.
Pure numpy: CI tests the policy on CPU.

Its per-step part runs on the engine loop's path, so it is a few Python operations: a step's trees are buffered
(:meth:`AcceptanceByBudget.observe`) and counted in one numpy pass when the window is read, exactly what counting
step by step gives (``tests/vllm_adapter/test_auto_budget.py`` keeps the eager version as the oracle); a step's
period is appended to the open probe's samples only while a probe runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

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
#: The weight of the past at each window (the rest is the new window's); also of an octave's earlier ratio when a
#: probe measures it again.
KEEP = 0.75
#: An octave leaves its budget only for a candidate at least this much faster.
SWITCH_MARGIN = 0.03
#: Windows between two probes of one octave, and the most probes per octave (a probe: one window of the octave's
#: budget and a neighbour in turns; enough to walk the default candidates from the largest to the smallest).
PROBE_EVERY = 4
MAX_PROBES = 4
#: Turns of a probe window (neighbour, current, neighbour, current): a budget's steps sit between the other's, so
#: the host's drift falls on both alike.
PROBE_BLOCKS = 4
#: Kept periods a probe needs of each budget at a batch size before that batch size's ratio counts.
MIN_PROBE_SAMPLES = 2
#: Steps in a row at one batch size after which a due probe opens at once, closing the window early, instead of
#: waiting for the window to close: a burst of requests stays at its full batch size for a dozen steps or so before
#: its tail, and a probe opened by the next window's close ran in the tail, where it measures nothing (the test
#: pair's batch of 32 stayed at 32 for 10-14 steps a run: ``gpu-h200-pair-38e16ce``, two probes, the 32-63 octave
#: unmeasured). A tail (one request fewer every step or two) never stays long enough.
SETTLE_STEPS = 2
#: Steps :class:`AcceptanceByBudget` buffers at most before counting them (a window is counted when it closes; this
#: bounds the buffer while no window closes, e.g. before vLLM's scheduler attached the lookup).
MAX_BUFFERED_STEPS = 64


def octave(trees: int) -> int:
    """The octave of a batch size: ``k + 1`` for ``[2^k, 2^(k+1))`` requests (0 for none)."""
    return int(trees).bit_length()


def octave_range(oct_: int) -> str:
    """An octave's batch sizes as the summary names them, ``"32-63"``."""
    return f"{1 << (oct_ - 1)}-{(1 << oct_) - 1}"


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


class ProbedRatios:
    """Step periods of neighbouring candidates relative to each other, per octave of batch sizes, as probes measured
    them in turns.

    A probe's kept periods are collected by (budget, trees) (:meth:`observe`); when it closes, each batch size that
    has :data:`MIN_PROBE_SAMPLES` periods of both budgets gives the log of the larger budget's median over the
    smaller's, and an octave's ratio is their mean weighted by samples, folded with what earlier probes of that
    octave measured (:data:`KEEP`). Probes pair neighbouring candidates, so the ratios of an octave link a run of
    candidates, and :meth:`relative` chains them.
    """

    #: Closed probes kept in :attr:`history` (the latest).
    HISTORY = 16

    def __init__(self):
        self._open: Dict[Tuple[int, int], List[float]] = {}  # (budget, trees) -> periods of the open probe
        # The latest probes: their pair, the kept periods each (budget, trees) got, and the octaves they measured
        # (a probe that measured none says why in its counts: too few periods of both budgets at one batch size).
        self.history: Deque[Dict[str, object]] = deque(maxlen=self.HISTORY)
        # octave -> {(smaller, larger): (log of larger's period over smaller's, weight)}
        self.log_ratios: Dict[int, Dict[Tuple[int, int], Tuple[float, float]]] = {}

    def observe(self, budget: int, trees: int, ms: float) -> None:
        """A kept period of the open probe (a few Python operations: the medians wait for :meth:`close`)."""
        if math.isfinite(ms) and ms > 0:
            self._open.setdefault((budget, trees), []).append(ms)

    def close(self, pair: Tuple[int, int], opened: Optional[str] = None) -> None:
        """Folds the open probe of budgets ``pair`` into each octave it timed both budgets in. ``opened``: what
        opened it, for :attr:`history` (e.g. ``"settled at 32"``)."""
        small, large = sorted(pair)
        kept = {f"{budget}@{trees}": len(periods) for (budget, trees), periods in sorted(self._open.items())}
        by_octave: Dict[int, List[Tuple[float, float]]] = {}
        for trees in sorted({n for _, n in self._open}):
            below, above = self._open.get((small, trees), ()), self._open.get((large, trees), ())
            if len(below) >= MIN_PROBE_SAMPLES and len(above) >= MIN_PROBE_SAMPLES:
                log_ratio = math.log(float(np.median(above)) / float(np.median(below)))
                by_octave.setdefault(octave(trees), []).append((log_ratio, float(min(len(below), len(above)))))
        self._open = {}
        entry = {"pair": [small, large], "kept": kept, "measured": [octave_range(o) for o in sorted(by_octave)]}
        self.history.append(entry if opened is None else dict(entry, opened=opened))
        for oct_, points in by_octave.items():
            weight = sum(w for _, w in points)
            value = sum(v * w for v, w in points) / weight
            earlier = self.log_ratios.setdefault(oct_, {}).get((small, large))
            if earlier is not None:
                kept = KEEP * earlier[1]
                value, weight = (value * weight + earlier[0] * kept) / (weight + kept), weight + kept
            self.log_ratios[oct_][(small, large)] = (value, weight)

    def measured(self, oct_: int, a: int, b: int) -> bool:
        return (min(a, b), max(a, b)) in self.log_ratios.get(oct_, {})

    def relative(self, oct_: int, candidates: Sequence[int], anchor: int) -> Dict[int, float]:
        """Each candidate linked to ``anchor`` by this octave's measured neighbour ratios -> its step period over
        ``anchor``'s (``anchor`` itself 1.0)."""
        ratios = self.log_ratios.get(oct_, {})
        at = list(candidates).index(anchor)
        logs = {anchor: 0.0}
        for step in (1, -1):
            log, i = 0.0, at
            while 0 <= i + step < len(candidates):
                lo, hi = sorted((candidates[i], candidates[i + step]))
                if (lo, hi) not in ratios:
                    break
                log += step * ratios[(lo, hi)][0]
                i += step
                logs[candidates[i]] = log
        return {c: math.exp(v) for c, v in logs.items()}

    def describe(self) -> Dict[str, Dict[str, float]]:
        """``{"32-63": {"63/127": ratio}}``: what the summary shows."""
        return {
            octave_range(o): {f"{hi}/{lo}": round(math.exp(v), 4) for (lo, hi), (v, _) in sorted(r.items())}
            for o, r in sorted(self.log_ratios.items())
        }


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
    """The live budget of every batch size (``lookup[n]``, ``n`` from 1 to ``max_num_seqs``), one per octave."""

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
        self.ratios = ProbedRatios()
        # The budget of each octave a probe has measured (the others follow them: :meth:`_fill_lookup`).
        self.octave_budgets: Dict[int, int] = {}
        self.window_steps, self.min_trees, self.margin = window_steps, min_trees, margin
        self._steps_in_window = 0
        self.decisions = 0
        self.changes = 0
        # Under asynchronous scheduling vLLM's scheduler places each step's drafts: the lookup may change only once
        # the scheduler reads this very list (``attach_scheduler``); synchronously the runner's proposals decide.
        self.needs_scheduler = False
        self.attached = False
        # A probe window runs two budgets in turns everywhere (``_probe_pair``: the first is run first); the lookup
        # it replaced is restored when it closes. Probes are counted per octave of the batch size the traffic had.
        self.probes = 0
        self._probe_steps = 0
        self._probe_pair: Tuple[int, int] = (self.candidates[0], self.largest)
        self._probe_opened = ""  # what opened the probe (``ProbedRatios.history``)
        self._probes_by_octave: Dict[int, Tuple[int, int]] = {}  # octave -> (probes, decision of the last)
        self._before_probe: Optional[List[int]] = None
        self._window_batch_sizes: Dict[int, int] = {}  # trees per observed step -> steps, this window
        # The latest step's trees (:meth:`note_step`) and how many steps in a row had them (:data:`SETTLE_STEPS`).
        self._last_trees, self._settled_steps = 0, 0
        # The step timer's latest periods (``StepTimer.trace``, which the runner hands over), for the summary.
        self.period_trace: Sequence[Tuple[int, int, float, bool]] = ()

    @property
    def probing(self) -> bool:
        return self._before_probe is not None

    def budget_for(self, num_requests: int) -> int:
        return self.lookup[min(max(num_requests, 0), len(self.lookup) - 1)]

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

    def note_step(self, trees: int) -> None:
        """A verify step's trees (0: a step without any), as it runs: the runner's acceptance reaches :meth:`observe`
        up to four steps later, in bursts (``counts.PathRing``), but whether the traffic has settled at a batch size
        (:data:`SETTLE_STEPS`) is known at once."""
        if trees == self._last_trees:
            self._settled_steps += 1
        else:
            self._last_trees, self._settled_steps = trees, 1

    @property
    def _probe_block(self) -> int:
        return max(1, self.window_steps // PROBE_BLOCKS)

    def observe_step_time(self, budget: int, trees: int, step_ms: float) -> None:
        """A kept step period (``StepTimer``): only a probe's count (periods taken at other times are not compared)."""
        if self.probing:
            self.ratios.observe(budget, trees, step_ms)

    def maybe_decide(self) -> Optional[bool]:
        """After a full window, or once the traffic has settled at a batch size a probe is due for (the window then
        closes early): folds it in and re-decides every octave. None: no decision this step; else whether the
        lookup changed."""
        if self.needs_scheduler and not self.attached:
            return None
        settled = self._settled_probe_size()
        if self._steps_in_window < self.window_steps and settled is None:
            return None
        self._steps_in_window = 0
        self.acceptance.close_window()
        self.decisions += 1
        before = list(self.lookup)
        if self.probing:
            self.ratios.close(self._probe_pair, self._probe_opened)
        self.decide()
        typical = settled if settled is not None else self._typical_batch_size()
        self._window_batch_sizes = {}
        neighbour = self._probe_due(typical) if typical is not None else None
        if neighbour is not None:
            self._before_probe = list(self.lookup)
            self._probe_pair = (neighbour, self.budget_for(typical))
            self.lookup[1:] = [neighbour] * (len(self.lookup) - 1)
            self._probe_steps = 0
            # (the window's close for its typical batch size, or the traffic settled at one: the summary says which)
            self._probe_opened = f"{'settled' if settled is not None else 'window'} at {typical}"
            self.probes += 1
            oct_ = octave(typical)
            self._probes_by_octave[oct_] = (self._probes_by_octave.get(oct_, (0, 0))[0] + 1, self.decisions)
        changed = self.lookup != before
        self.changes += int(changed)
        return changed

    def _settled_probe_size(self) -> Optional[int]:
        """The batch size the traffic has just stayed at for :data:`SETTLE_STEPS` steps (:meth:`note_step`), if no
        probe runs and one is due there: checked once per such run of steps, at its :data:`SETTLE_STEPS`-th step
        (a few Python operations on the others)."""
        if self._settled_steps != SETTLE_STEPS or self.probing or not self._last_trees:
            return None
        return self._last_trees if self._probe_due(self._last_trees) is not None else None

    def _typical_batch_size(self) -> Optional[int]:
        """The trees per step the window saw most often (the larger on a tie), if at least half its steps had them;
        else None: a window that passed through batch sizes (a batch's tail, requests arriving) opens no probe. A
        probe there ran a neighbour's trees for half a window and measured nothing: too few periods of one batch
        size between budget changes (on the test pair at batch 8, 10 probes left ratios of two pairs in one octave:
        8 or more measured nothing, ``gpu-h200-pair-f3b4972``)."""
        if not self._window_batch_sizes:
            return None
        typical = max(self._window_batch_sizes, key=lambda n: (self._window_batch_sizes[n], n))
        steps = sum(self._window_batch_sizes.values())
        return typical if 2 * self._window_batch_sizes[typical] >= steps else None

    def _unmeasured_neighbour(self, trees: int) -> Optional[int]:
        """The candidate next above the budget of ``trees``' octave, else next below, whose ratio to it that octave
        has not measured (None: both measured, or no other candidate)."""
        budget, oct_ = self.budget_for(trees), octave(trees)
        i = self.candidates.index(budget)
        for j in (i + 1, i - 1):
            if 0 <= j < len(self.candidates) and not self.ratios.measured(oct_, budget, self.candidates[j]):
                return self.candidates[j]
        return None

    def _probe_due(self, trees: int) -> Optional[int]:
        """The neighbour to probe with the budget of ``trees``' octave, if a probe is due: one is unmeasured there,
        at most :data:`MAX_PROBES` per octave, :data:`PROBE_EVERY` windows apart (the first at the first decision that
        sees the octave)."""
        neighbour = self._unmeasured_neighbour(trees)
        if neighbour is None:
            return None
        done, last = self._probes_by_octave.get(octave(trees), (0, 0))
        return neighbour if done < MAX_PROBES and (done == 0 or self.decisions >= last + PROBE_EVERY) else None

    def decide(self) -> None:
        """Re-decides every measured octave in place (the list object is shared with vLLM's scheduler), then fills
        the lookup; a probe's lookup is replaced by the decided one."""
        self._before_probe = None
        tau = self.acceptance.acceptance_length(self.min_trees)
        for oct_ in sorted(self.ratios.log_ratios):
            current = self.octave_budgets.get(oct_, self._inherited(oct_))
            self.octave_budgets[oct_] = self._best(oct_, current, tau)
        self._fill_lookup()

    def _best(self, oct_: int, current: int, tau: Mapping[int, float]) -> int:
        """The candidate linked to ``current`` by measured ratios with the most accepted tokens per period (the
        smaller on a tie); ``current`` unless the best beats it by more than the margin, or while its own acceptance
        is not trusted yet."""
        if current not in tau:
            return current
        relative = self.ratios.relative(oct_, self.candidates, current)
        rates = {c: tau[c] / period for c, period in relative.items() if c in tau}
        best = max(rates, key=lambda c: (rates[c], -c))
        return best if rates[best] > rates[current] * (1 + self.margin) else current

    def _inherited(self, oct_: int) -> int:
        """The budget an octave without its own measurement takes: the nearest measured octave's (the one above, of
        larger batches, on a tie: its budget is the smaller, the cheaper mistake), else the largest candidate.
        Nearest, not always below: the tail of a batch of 32 (16-31 requests for a few steps) then keeps the batch's
        budget instead of switching to one request's, a switch that costs a step of cut trees and new step shapes
        (``benches/bench_auto_traffic.py``)."""
        if not self.octave_budgets:
            return self.largest
        nearest = min(self.octave_budgets, key=lambda o: (abs(o - oct_), o < oct_))
        return self.octave_budgets[nearest]

    def _fill_lookup(self) -> None:
        by_octave = {
            oct_: self.octave_budgets.get(oct_, self._inherited(oct_))
            for oct_ in range(1, octave(len(self.lookup)) + 1)
        }
        self.lookup[1:] = [by_octave[octave(n)] for n in range(1, len(self.lookup))]
        self.lookup[0] = self.lookup[1] if len(self.lookup) > 1 else self.largest

    def describe(self) -> str:
        """The lookup as ranges, ``1-4: 63, 5-32: 15``, and what it rests on."""
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
            f"probing budgets {self._probe_pair[0]} and {self._probe_pair[1]} in turns for one window; "
            if self.probing
            else ""
        )
        return (
            f"{probe}budget by batch size {', '.join(ranges)} (acceptance length by budget {accept or 'not yet known'})"
        )

    def summary(self) -> Dict[str, object]:
        return {
            "candidates": list(self.candidates),
            "lookup": self.describe(),
            "decisions": self.decisions,
            "changes": self.changes,
            "acceptance_length": self.acceptance.acceptance_length(self.min_trees),
            "probes": self.probes,
            # What it rests on: each octave's measured period ratios of neighbouring budgets, and its budget.
            "period_ratios": self.ratios.describe(),
            "octave_budgets": {octave_range(o): b for o, b in sorted(self.octave_budgets.items())},
            # The latest step periods, kept or not, oldest first: (budget, trees, ms, kept).
            "step_periods": [list(period) for period in self.period_trace],
            # The latest probes: pair, kept periods by "budget@trees", octaves measured.
            "probe_history": list(self.ratios.history),
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
