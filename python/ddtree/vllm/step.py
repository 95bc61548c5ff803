"""The per-step bookkeeping of DDTree inside vLLM, on CPU arrays only.

No vLLM or torch import: this is the part of the adapter CI can test
exhaustively. The runner (``runner.py``) feeds it vLLM's batch layout and
turns its numpy outputs into GPU tensors.

Life of a tree:

1. *Propose* (end of step t): the drafter's top-K ``[R, L, K]`` goes through
   :meth:`TreeStore.propose`, which builds the trees in one Rust call, keeps
   each request's draft distribution, and returns the flat token lists vLLM's
   scheduler receives (tree nodes in pop order, parents before children).
2. *Schedule*: vLLM may verify only a prefix of a request's list (token budget,
   ``max_model_len``). A prefix of pop order is the best tree of that smaller
   budget, which :func:`plan_verify` rebuilds from the kept distribution.
3. *Verify* (step t+1): :func:`plan_verify` gives depth-based positions, the
   ancestor bitmasks of the tree attention and the logits row of every node.
4. *Accept*: the Rust walk (:func:`accept`) returns vLLM's chain format and
   the KV moves; :func:`drafter_context_order` reorders the target hidden
   states so the drafter is conditioned on the accepted path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import types
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

import ddtree
from ddtree.errors import DDTreeError
from ddtree.vllm.config import tree_size

PLACEHOLDER = -1


@dataclasses.dataclass
class DraftRecord:
    """One request's proposal: its draft distribution and the tree it produced."""

    log_probs: Optional[np.ndarray]  # [L, K] float32 (None: deferred, until :meth:`TreeStore.settle`)
    token_ids: Optional[np.ndarray]  # [L, K] int64 or int32 (None: deferred)
    tokens: Optional[np.ndarray]  # [n] int64, the tree's draft tokens in pop order (None: not built here)
    token_list: Optional[List[int]] = None  # the same tokens as the list handed to vLLM's scheduler
    budget: int = 0  # the budget the tree was proposed with (a verified tree with fewer nodes was cut)


@dataclasses.dataclass
class DeferredProposal:
    """A batch's top-K on its way to the host: ``host`` ``[R, L, 2K]`` float32 (log-probs, then the ids' int32
    bits), valid once ``landed`` (an object with ``synchronize()``, e.g. a CUDA event; None: already there)."""

    host: np.ndarray
    top_k: int
    landed: Any = None
    req_ids: Tuple[str, ...] = ()


@dataclasses.dataclass
class WholeProposal:
    """A deferred proposal none of whose requests has needed a record of its own yet: the usual late step verifies
    exactly its requests, in its order, and takes its top-K whole (no per-request record is made, filled or taken).
    The first use of one of its requests on its own (a discard, a proposal, another order) records them all."""

    req_ids: Tuple[str, ...]
    budget: int  # every tree's proposal budget
    size: int  # the placeholder drafts each request was given (the tree's size)
    log_probs: Optional[np.ndarray] = None  # [R, L, K] float32, once settled
    token_ids: Optional[np.ndarray] = None  # [R, L, K] int32, once settled
    # A device-planned subset step's (``take_subset_unsettled``): the proposal it came from (its request ids, the
    # tuple) and each of its requests' row there; None: the proposal itself.
    source: Optional[Tuple[str, ...]] = None
    rows: Optional[np.ndarray] = None


class TreeStore:
    """Draft records by request id, from proposal to verification.

    A record lives until the request is verified, finishes, or is proposed
    again: a request that is not scheduled in the step after its proposal
    keeps its draft tokens in vLLM's scheduler, so its record must survive.
    """

    def __init__(self, budget: int, num_threads: int = 1):
        self.budget = budget
        self.executor = ddtree.Executor(num_threads) if num_threads > 1 else None
        self._records: Dict[str, DraftRecord] = {}
        # The last deferred proposal while none of its requests has a record (see WholeProposal).
        self._whole: Optional[WholeProposal] = None
        # A whole proposal a device-planned step took before its top-K reached the host (:meth:`take_unsettled`):
        # :meth:`settle` gives it its arrays, for the host's copy of its trees (``DeferredTrees``).
        self._taken_whole: Optional[WholeProposal] = None
        # The last proposal's trees and their requests, in order: a verification of exactly those trees
        # (every request scheduled whole, none added) reuses them instead of building them again.
        self.last_batch: Optional[Tuple[Tuple[str, ...], "ddtree.TreeBatch"]] = None

        # A proposal whose top-K is still on its way to the host (:meth:`defer`): its records get their arrays
        # at :meth:`settle`.
        self.deferred: Optional[DeferredProposal] = None
        # The last settled proposal's top-K whole, ``({request: (its record, its row)}, log_probs [R, L, K],
        # token_ids [R, L, K])``: its records hold rows of these arrays, and a verification of them takes its
        # batch's rows in one gather (:func:`top_k_arrays`).
        self.settled: Optional[Tuple[Dict[str, Tuple["DraftRecord", int]], np.ndarray, np.ndarray]] = None
        # The same proposal's requests and records in its row order, when every one of its requests got its row
        # (none was proposed again or finished before the settle): a verification of exactly these records, in
        # this order, takes the arrays whole (one identity test per record, no index).
        self.settled_in_order: Optional[Tuple[Tuple[str, ...], List["DraftRecord"]]] = None

    @property
    def records(self) -> Dict[str, DraftRecord]:
        """Every request's record (a whole deferred proposal's requests get theirs first)."""
        self._record_whole()
        return self._records

    def __len__(self) -> int:
        return len(self.records)

    def _record_whole(self) -> None:
        """Gives each request of the whole proposal its record, as a deferred proposal's requests had them before
        the whole-step shortcut: rows of its settled top-K, or arrays to come at :meth:`settle`."""
        whole, self._whole = self._whole, None
        if whole is None:
            return
        for req_id in whole.req_ids:
            self._records[req_id] = DraftRecord(None, None, None, budget=whole.budget)
        if whole.log_probs is not None:  # settled already (else settle() fills them)
            self._fill_records(whole.req_ids, whole.log_probs, whole.token_ids)

    def whole_proposal_of(self, req_ids: Sequence[str], settled: bool = True) -> Optional[WholeProposal]:
        """The whole proposal when its requests are exactly ``req_ids``, in order, and (``settled``) its top-K has
        reached the host (None: not so)."""
        whole = self._whole
        if whole is None or (settled and whole.log_probs is None):
            return None
        if whole.req_ids is not req_ids and whole.req_ids != tuple(req_ids):
            return None
        return whole

    def take_whole(self) -> None:
        """Takes every request of the whole proposal (their records, had they been made, taken one by one)."""
        self._whole = None

    def take_unsettled(self) -> WholeProposal:
        """:meth:`take_whole` for a step whose trees are built on the device (``ddtree.vllm.device_plan``): the
        proposal is returned, and gets its top-K arrays at :meth:`settle` if it has not yet."""
        whole, self._whole = self._whole, None
        if whole is None:
            raise RuntimeError("DDTree: no whole proposal to take (a bug)")
        if whole.log_probs is None:
            self._taken_whole = whole
        return whole

    def take_subset_unsettled(self, req_ids: Tuple[str, ...], rows: np.ndarray, source: Tuple[str, ...], size: int):
        """For a device-planned step of some of the deferred proposal's requests (others finished, or the order
        changed: ``rows`` are theirs in that proposal, whose request ids are ``source``): takes their records and
        returns them as one :class:`WholeProposal` of the step's order (trees of ``size`` nodes), whose top-K arrays
        come at :meth:`settle`. None, and nothing taken, unless that proposal's copy is still on its way (so every
        record of its requests is its own and the device still keeps its top-K) and each request has a record of
        its budget, ``size``."""
        deferred = self.deferred
        if deferred is None or deferred.req_ids is not source:
            return None  # (settled, or another proposal's: a record could be a later proposal's than the kept rows)
        if self._taken_whole is not None:
            return None  # (a step took from this copy already: one device-planned step per drafter pass)
        whole = self._whole
        if whole is not None:
            if whole.budget != size:
                return None  # (checked before the records are made: the host plan keeps its whole-step path)
            self._record_whole()
        records = [self._records.get(req_id) for req_id in req_ids]
        if not records or any(r is None for r in records) or {r.budget for r in records} != {size}:
            return None  # (a request without a record, or trees not whole at their budget: the device builds those)
        for req_id in req_ids:
            del self._records[req_id]
        self._taken_whole = WholeProposal(tuple(req_ids), size, size, source=source, rows=rows)
        return self._taken_whole

    def defer(
        self, req_ids: Sequence[str], proposal: "DeferredProposal", budget: Optional[int] = None
    ) -> List[List[int]]:
        """Keeps a proposal whose top-K is still on its way to the host; returns each request's placeholder
        drafts (``PLACEHOLDER`` x the size of the tree it will get: all vLLM's scheduler needs).

        The trees are built at the verification (:func:`plan_verify`), after :meth:`settle`. The caller settles the
        previous deferred proposal before it queues the drafter pass whose top-K kernel (or copy) overwrites that
        proposal's host buffer.
        """
        budget = self._step_budget(budget)
        if self.deferred is not None:
            raise RuntimeError("DDTree: a deferred proposal was not settled before the next one (a bug)")
        if len(req_ids) != proposal.host.shape[0]:
            raise ValueError(f"{len(req_ids)} request ids for {proposal.host.shape[0]} deferred distributions")
        self._record_whole()  # an earlier proposal's unverified requests keep what they need
        self.last_batch = None
        self.deferred = proposal
        size = tree_size(budget, proposal.top_k, proposal.host.shape[1])
        proposal.req_ids = tuple(req_ids)
        if self._records:  # this proposal replaces these requests' earlier records
            for req_id in proposal.req_ids:
                self._records.pop(req_id, None)
        self._whole = WholeProposal(proposal.req_ids, budget, size)
        return [[PLACEHOLDER] * size for _ in req_ids]

    def has_landed(self) -> bool:
        """Whether :meth:`settle` would return without waiting for the GPU (no deferred proposal, or its copy done)."""
        proposal = self.deferred
        return proposal is None or proposal.landed is None or bool(proposal.landed.query())

    def settle(self) -> None:
        """Waits for the deferred proposal's rows to reach the host (the event after the kernel's write or the copy),
        if any, and gives its remaining records their own arrays, copied out of the reused buffer."""
        proposal, self.deferred = self.deferred, None
        if proposal is None:
            return
        if proposal.landed is not None:
            proposal.landed.synchronize()
        k = proposal.top_k
        # One copy of each (the host buffer is reused by the next proposal); the records hold rows of them.
        log_probs = np.array(proposal.host[..., :k])
        token_ids = np.array(proposal.host[..., k:].view(np.int32))
        taken, self._taken_whole = self._taken_whole, None
        if taken is not None and taken.source is proposal.req_ids:  # a subset taken by a device-planned step
            taken.log_probs, taken.token_ids = log_probs[taken.rows], token_ids[taken.rows]
        elif taken is not None and taken.req_ids is proposal.req_ids:  # taken whole by a device-planned step
            taken.log_probs, taken.token_ids = log_probs, token_ids
            self.settled = self.settled_in_order = None
            return
        whole = self._whole
        if whole is not None and whole.req_ids is proposal.req_ids:  # no request recorded: the arrays, whole
            whole.log_probs, whole.token_ids = log_probs, token_ids
            self.settled = self.settled_in_order = None
            return
        self._fill_records(proposal.req_ids, log_probs, token_ids)

    def _fill_records(self, req_ids: Tuple[str, ...], log_probs: np.ndarray, token_ids: np.ndarray) -> None:
        """Gives the records of a settled proposal's requests (``req_ids``, its row order) that still wait for
        arrays their rows of ``log_probs`` / ``token_ids``, and keeps the proposal whole (:attr:`settled`)."""
        rows, in_order = {}, []
        for r, req_id in enumerate(req_ids):
            record = self._records.get(req_id)
            if record is not None and record.log_probs is None:
                record.log_probs, record.token_ids = log_probs[r], token_ids[r]
                rows[req_id] = (record, r)
                in_order.append(record)
        self.settled = (rows, log_probs, token_ids)
        self.settled_in_order = (req_ids, in_order) if len(in_order) == len(req_ids) else None

    def _step_budget(self, budget: Optional[int]) -> int:
        budget = self.budget if budget is None else budget
        if not 1 <= budget <= self.budget:
            raise ValueError(f"a step's budget must be in 1..{self.budget} (the engine's largest), got {budget}")
        return budget

    def propose(
        self,
        req_ids: Sequence[str],
        log_probs: np.ndarray,
        token_ids: np.ndarray,
        build: bool = True,
        budget: Optional[int] = None,
    ) -> List[List[int]]:
        """Builds every request's tree in one call; returns the draft token lists.

        ``budget``: this step's (from a budget schedule; default the store's, the largest).
        ``build=False`` (tensor-parallel ranks other than the one whose drafts
        vLLM's scheduler takes) only keeps the distributions: such a rank
        builds its trees at verification, from the scheduled drafts' count,
        and checks them against the drafts the scheduler sent to every rank.
        """
        if len(req_ids) != log_probs.shape[0]:
            raise ValueError(f"{len(req_ids)} request ids for {log_probs.shape[0]} distributions")
        budget = self._step_budget(budget)
        self.settle()  # a deferred proposal left unverified (late trees switched off meanwhile) keeps its records
        self._record_whole()
        if len(req_ids) == 0:
            return []
        self.last_batch = None
        if not build:
            for r, req_id in enumerate(req_ids):
                self._records[req_id] = DraftRecord(log_probs[r], token_ids[r], None, budget=budget)
            return [[] for _ in req_ids]
        batch = ddtree.build_trees(log_probs, token_ids, budget, self.executor)
        self.last_batch = (tuple(req_ids), batch)
        tokens = batch.tokens
        offsets = batch.token_offsets
        lists = []
        for r, req_id in enumerate(req_ids):
            own = tokens[offsets[r] : offsets[r + 1]]
            own_list = own.tolist()
            self._records[req_id] = DraftRecord(log_probs[r], token_ids[r], own, own_list, budget)
            lists.append(own_list)
        return lists

    def discard(self, req_ids) -> None:
        if self._whole is not None and not set(req_ids).isdisjoint(self._whole.req_ids):
            self._record_whole()
        for req_id in req_ids:
            self._records.pop(req_id, None)

    def take(self, req_id: str) -> Optional[DraftRecord]:
        self._record_whole()
        return self._records.pop(req_id, None)


class DraftMismatchError(DDTreeError, RuntimeError):
    """vLLM scheduled draft tokens that are not a prefix of the request's tree."""


#: ``name -> (dtype, shape)`` of the arrays one layout call writes.
ArraySpecs = Dict[str, Tuple[np.dtype, Tuple[int, ...]]]


def cut_trees(num_nodes: np.ndarray, proposed_budgets: np.ndarray) -> int:
    """Trees verified with fewer nodes than they were proposed with (the scheduler cut them): ``num_nodes`` counts
    each tree's root, ``proposed_budgets`` its proposal's drafts (one step's trees, or several steps' in a row)."""
    return int((num_nodes < proposed_budgets + 1).sum())


def prefill_beside_trees(plan: "VerifyPlan") -> bool:
    """Whether a verify step scheduled other tokens than its trees' (a request's prefill beside them)."""
    return plan.num_tokens > int(plan.num_nodes.sum())


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` for the plan's small integer arrays: by their bytes when dtype and shape agree (~0.5 us
    against ~5 for ``array_equal`` on a CPU; the step's checks run on the engine loop's path), else by value."""
    if a.dtype == b.dtype and a.shape == b.shape:
        return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    return bool(np.array_equal(a, b))


def numpy_arrays(specs: ArraySpecs) -> Dict[str, np.ndarray]:
    """Fresh arrays for a layout (the runner passes views of its pinned staging buffer instead)."""
    return {name: np.empty(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}


@dataclasses.dataclass
class VerifyPlan:
    """Everything the verification step needs, for the requests that verify a tree.

    The arrays are written by one Rust call (:func:`ddtree.verify_layout_into`) into what the caller's
    allocator returned: in the runner, views of the pinned buffer it uploads in one copy.
    """

    batch_index: np.ndarray  # [R_t] int64: the tree requests' rows in vLLM's input batch
    trees: "ddtree.TreeBatch"
    token_index: np.ndarray  # [T] int64: flat index of each node among the step's scheduled tokens
    logit_rows: np.ndarray  # [T] int64: row of each node in the step's logits
    positions: np.ndarray  # [T] int64: start + depth
    ancestor_bits: np.ndarray  # [T, words] int32 bit rows (tree-local, row i bit j: j is ancestor-or-self of i)
    row_start: np.ndarray  # [num_reqs] int32: first ancestor_bits row of each request, -1 if no tree
    node_offsets: np.ndarray  # [R_t + 1] int32: the trees' CSR offsets
    num_nodes: np.ndarray  # [R_t] int64: b + 1 (root included)
    query_starts: np.ndarray  # [R_t] int64: each tree's root among the step's scheduled tokens
    num_tokens: int  # the step's scheduled tokens
    proposed_budgets: np.ndarray  # [R_t] int64: each tree's budget at proposal
    conv_index: Optional[np.ndarray] = None  # [T, w + 1] int64 (hybrid targets): rows of cat(histories, inputs)
    conv_window: int = 0
    # Trees verified for placeholders without a proposal (asynchronous scheduling; ``filler_record``): real trees of
    # no drafter, counted apart (their drafts are never the target's but cost a verification).
    filler_mask: Optional[np.ndarray] = None  # [R_t] bool: which trees are fillers (None: none is)
    top1_tokens: Optional[np.ndarray] = None  # [R_t, L] the drafter's top-1 token per depth (the chain's drafts)
    # Placeholder drafts were scheduled (late trees): every draft node's index among the step's tokens and its token,
    # for the runner to write into the input ids (None: vLLM's input ids already hold the drafts).
    draft_step_index: Optional[np.ndarray] = None  # [T - R_t] int64
    draft_tokens: Optional[np.ndarray] = None  # [T - R_t] int32
    # Set by the runner once the plan is on the device: the sampler's rows, the tree rows of the batch, and the
    # device walk's inputs (``ddtree.vllm.device_accept.DeviceTrees``; None unless DDTREE_DEVICE_ACCEPT is on).
    logit_rows_gpu: Optional[Any] = None
    batch_index_gpu: Optional[Any] = None
    device_trees: Optional[Any] = None
    # The runner's number for the step, uploaded with the plan: the slot of its accepted paths in the statistics'
    # ring (``ddtree.vllm.counts.PathRing``; -1: none).
    step_serial: int = -1
    # A step whose trees were built on the device (``ddtree.vllm.device_plan``): ``trees`` and ``top1_tokens`` are
    # None until :meth:`host_trees` builds the host's copy, and the arrays that depend on the trees (positions,
    # ancestor bits, conv index, draft tokens) are not this step's (they live on the device only).
    deferred_trees: Optional["DeferredTrees"] = None

    @property
    def draft_depth(self) -> int:
        """The drafter's depth L the trees were built from (the walk's path width is ``L + 1``)."""
        if self.trees is None:
            return self.deferred_trees.draft_depth
        return int(self.trees.draft_depth)

    def host_trees(self) -> "ddtree.TreeBatch":
        """The step's trees on the host: :attr:`trees`, built first for a device-planned step (from its top-K once
        that has reached the host; :attr:`top1_tokens` with them). Off the usual step's path: the statistics read
        them, and a step whose sampling reads each node's depth or root path (min_tokens, penalties, bad words)."""
        if self.trees is None:
            self.trees, self.top1_tokens = self.deferred_trees.build()
        return self.trees

    @property
    def num_filler_trees(self) -> int:
        return 0 if self.filler_mask is None else int(self.filler_mask.sum())

    def every_request(self, num_reqs: int) -> bool:
        """Whether each of the step's ``num_reqs`` requests verifies a tree: the tree rows are then the batch's rows
        ``0 .. num_reqs - 1`` in order (they are ascending and distinct), and each request's logits rows its nodes."""
        return self.batch_index.shape[0] == num_reqs

    @functools.cached_property
    def deepest(self) -> np.ndarray:
        """``[R_t]``: each tree's deepest node's depth (read by the drafter's fit test and the statistics). A
        device-planned step's trees are not on the host: the drafter's depth bounds them (such a step is far enough
        from ``max_model_len`` that the fit test's answer is the same, ``device_plan.fits_far_from_the_end``)."""
        if self.trees is None:
            return np.full(self.num_nodes.shape[0], self.deferred_trees.draft_depth, dtype=np.int64)
        return np.maximum.reduceat(self.trees.depths, self.trees.node_offsets[:-1].astype(np.int64))

    @property
    def num_cut_trees(self) -> int:
        return cut_trees(self.num_nodes, self.proposed_budgets)

    @property
    def words(self) -> int:
        return int(self.ancestor_bits.shape[1])

    @property
    def num_tree_tokens(self) -> int:
        return int(self.token_index.shape[0])


@dataclasses.dataclass
class DeferredTrees:
    """A device-planned step's trees, for the host to build when it reads them (the statistics, a few steps later):
    the Rust core's build of the same top-K and budget, which the device's build equals (``tree_build_triton``)."""

    store: TreeStore
    whole: WholeProposal
    draft_depth: int

    def build(self) -> Tuple["ddtree.TreeBatch", np.ndarray]:
        """The trees and the drafter's top-1 token per depth (``[R, L]``)."""
        whole = self.whole
        if whole.log_probs is None:
            self.store.settle()  # its copy is still the store's deferred one: wait for it
        if whole.log_probs is None:
            raise RuntimeError("DDTree: a device-planned step's top-K never reached the host (a bug)")
        budgets = _uniform_step(len(whole.req_ids), whole.budget).budgets
        trees = ddtree.build_trees(whole.log_probs, whole.token_ids, budgets, self.store.executor)
        return trees, whole.token_ids[:, :, 0]


def take_device_plannable(
    store: TreeStore,
    req_ids: Sequence[str],
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    top_k_kept: Callable[[tuple], bool],
) -> Optional[WholeProposal]:
    """The store's whole proposal, taken (:meth:`TreeStore.take_unsettled`), when this step verifies exactly its
    trees, each whole, in its order, with placeholders of its budget (trees of ``budget + 1`` nodes: what the device
    build makes), and ``top_k_kept(its request ids)`` says the device holds its top-K, whether or not that has
    reached the host; None otherwise, and nothing is taken. The same test as :func:`plan_verify`'s usual late step,
    without the settled top-K."""
    whole, _ = _whole_late_step(store, req_ids, scheduled_spec_tokens, settled=False)
    if whole is None or whole.size != whole.budget or not top_k_kept(whole.req_ids):
        return None
    return store.take_unsettled()


def take_device_subset(
    store: TreeStore,
    req_ids: Sequence[str],
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    kept: Optional[Tuple[str, ...]],
    rows_in_kept: Callable[[Sequence[str]], Optional[np.ndarray]],
) -> Optional[Tuple[WholeProposal, np.ndarray]]:
    """For ``DDTREE_DEVICE_PLAN_SUBSETS``: when this step's requests are some of the proposal whose top-K the device
    keeps (``kept``: its request ids), in any order, each verifying its whole tree (placeholders of its budget, all
    of them), their records taken as one proposal of the step's order and their rows in ``kept``
    (``rows_in_kept``); None otherwise, and nothing is taken. The step the device plan's whole-proposal test
    (:func:`take_device_plannable`) turns down after a request ends: vLLM moves another into its slot."""
    if kept is None or not req_ids:
        return None
    scheduled = list(map(scheduled_spec_tokens.get, req_ids))
    if not all(scheduled):
        return None
    size = _late_uniform_budget(scheduled, (), True)
    rows = rows_in_kept(req_ids) if size is not None else None
    if rows is None:
        return None
    taken = store.take_subset_unsettled(tuple(req_ids), rows, kept, size)
    return None if taken is None else (taken, rows)


def plan_verify(
    store: TreeStore,
    req_ids: Sequence[str],
    num_computed_tokens: np.ndarray,
    num_scheduled_tokens: np.ndarray,
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    conv_window: int = 0,
    words: Optional[int] = None,
    arrays: Callable[[ArraySpecs], Dict[str, np.ndarray]] = numpy_arrays,
    unproposed: Optional[Tuple[int, int]] = None,
) -> Optional[VerifyPlan]:
    """Builds the verification of this step's trees (``None``: no request verifies one).

    Args:
        req_ids: vLLM's input-batch order (row i is request ``req_ids[i]``).
        num_computed_tokens: ``[num_reqs]`` committed tokens before this step;
            the root (last sampled token) sits at that position.
        num_scheduled_tokens: ``[num_reqs]`` query tokens of this step.
        scheduled_spec_tokens: draft tokens vLLM scheduled, by request id.
        conv_window: ``W - 1`` of the target's GDN conv (0: no GDN layers);
            when > 0 the plan carries :attr:`VerifyPlan.conv_index`.
        words: the ancestor-bit row width (default: what the largest tree needs;
            the runner's fixed-address buffers have one width for every step).
        arrays: allocates the plan's arrays from ``name -> (dtype, shape)``.
        unproposed: ``(L, K)``: placeholder drafts of a request without a proposal verify a filler tree of that
            draft shape (wider where K cannot fill them) instead of raising: asynchronous scheduling schedules
            placeholders for every decoding request, also where the drafter did not run, and vLLM pads a request's
            first decode with them in any scheduling; any draft tokens are valid, the verification keeps only what
            the target samples. (The runner always passes it; real drafts without a proposal still raise.)

    Raises:
        DraftMismatchError: scheduled drafts that are not a prefix of the
            request's recorded tree (never verified silently).
    """
    store.settle()  # a deferred proposal's arrays (the runner waits here, in its own profiler range, first)
    num_reqs = len(req_ids)
    num_scheduled_tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)[:num_reqs]
    num_computed_tokens = np.asarray(num_computed_tokens, dtype=np.int64)[:num_reqs]
    whole, scheduled = _whole_late_step(store, req_ids, scheduled_spec_tokens)
    if whole is not None:
        # The usual late step: every request of the last proposal verifies its whole tree, in the proposal's order.
        # Its requests never got records: nothing per request is looked up or taken.
        store.take_whole()
        rows, records, filler = range(num_reqs), None, []
    else:
        rows, records, scheduled, filler = _take_records(store, req_ids, scheduled_spec_tokens, unproposed)
    if not rows:
        return None
    every_request = len(rows) == num_reqs  # a step of decodes: the tree rows are the requests, in order
    late = whole.size if whole is not None else _late_uniform_budget(scheduled, filler, every_request)
    if late is not None:
        # Every request verifies a late tree of one size (the usual step under asynchronous scheduling): its
        # counts are constants of the step's shape, made once.
        shape = _uniform_step(num_reqs, late)
        budgets, expected_scheduled = shape.budgets, shape.num_scheduled
    else:
        budgets = np.fromiter(map(len, scheduled), dtype=np.int64, count=len(scheduled))
        expected_scheduled = budgets + 1
    tree_scheduled = num_scheduled_tokens if every_request else num_scheduled_tokens[rows]
    if not same_values(tree_scheduled, expected_scheduled):
        j = int(np.flatnonzero(tree_scheduled != budgets + 1)[0])
        raise DraftMismatchError(
            f"request {req_ids[rows[j]]}: {tree_scheduled[j]} tokens scheduled with {budgets[j]} drafts "
            f"(expected {budgets[j] + 1})"
        )
    if late is not None:
        query_start = shape.query_start  # (the scheduled counts were just found equal to the shape's)
    else:
        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.add.accumulate(num_scheduled_tokens, out=query_start[1:])
    if every_request:
        logit_start = query_start  # b + 1 tokens and b + 1 logits rows for every request
    else:
        # Logits layout of vLLM's spec-decode metadata: num_draft + 1 rows per request (one without drafts).
        logit_rows = np.ones(num_reqs, dtype=np.int64)
        logit_rows[rows] += budgets
        logit_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.add.accumulate(logit_rows, out=logit_start[1:])
    tree_ids = req_ids if every_request else [req_ids[i] for i in rows]
    # Placeholder drafts (a late proposal's, see TreeStore.defer): vLLM holds only their count; the tokens are the
    # trees built here, and the runner writes them into the step's input ids.
    if late is not None:
        placeholders = None  # all of them (made an array only for a mismatch's diagnosis)
    else:
        placeholders = _placeholders(scheduled)
    # (A whole proposal is a deferred one: no trees were built at its proposal.)
    trees = _proposed_trees(store, tree_ids, records, budgets) if records is not None else None
    token_ids = None  # the records' top-K ids when gathered for a build here
    if trees is not None:
        # The proposal's own trees: the scheduled drafts must be the lists handed to vLLM (compared as lists).
        if any(list(d) != r.token_list for d, r in zip(scheduled, records)):
            raise _draft_mismatch(tree_ids, records, scheduled_spec_tokens, trees, _placeholders(scheduled))
    else:
        if whole is not None:
            log_probs, token_ids = whole.log_probs, whole.token_ids
        else:
            log_probs, token_ids = top_k_arrays(store, tree_ids, records)
        trees = ddtree.build_trees(log_probs, token_ids, budgets, store.executor)
        # One comparison for the whole batch: the rebuilt trees (a prefix of pop order is the tree of the smaller
        # budget) must be exactly the scheduled drafts. The per-request diagnosis runs only on failure.
        # Only the known drafts are read into an array: a late step's are all placeholders (32 x 256 Python ints at
        # batch 32, ~0.15 ms a step for nothing).
        offsets = trees.token_offsets
        if late is not None:
            same = same_values(offsets, shape.token_offsets)
        elif placeholders.all():  # a late step: vLLM holds only the counts (np.diff costs ~4 us more than slices)
            same = same_values(offsets[1:] - offsets[:-1], budgets)
        else:
            known_rows = [d for d, placeholder in zip(scheduled, placeholders) if not placeholder]
            count = int(budgets[~placeholders].sum())
            drafts = np.fromiter(itertools.chain.from_iterable(known_rows), dtype=np.int64, count=count)
            if placeholders.any():
                same = same_values(offsets[1:] - offsets[:-1], budgets) and same_values(
                    trees.tokens[np.repeat(~placeholders, budgets)], drafts
                )
            else:
                same = same_values(trees.tokens, drafts)
        if not same:
            records = records if records is not None else [None] * len(tree_ids)  # (placeholders: not read)
            raise _draft_mismatch(tree_ids, records, scheduled_spec_tokens, trees, _placeholders(scheduled))
    if whole is not None:
        proposed = _uniform_step(num_reqs, whole.budget).budgets
    else:
        proposed = np.fromiter((r.budget for r in records), dtype=np.int64, count=len(records))
    plan = _lay_out(
        trees,
        rows if late is None else shape.rows,
        proposed,
        num_reqs,
        num_computed_tokens,
        query_start,
        logit_start,
        conv_window,
        words,
        arrays,
        late is not None or bool(placeholders.any()),
        num_nodes=None if late is None else shape.num_scheduled,  # (whole trees: their drafts were checked above)
    )
    if any(filler):
        plan.filler_mask = np.array(filler, dtype=bool)
    # The chain's drafts, for the statistics (the top-K rows are sorted): from the ids gathered for the build, else
    # record by record (settled above: always set; statistics only, so never raise).
    if token_ids is not None:
        plan.top1_tokens = token_ids[:, :, 0]
    elif records is not None and all(r.token_ids is not None for r in records):
        plan.top1_tokens = np.stack([r.token_ids[:, 0] for r in records])
    return plan


def _whole_late_step(
    store: TreeStore,
    req_ids: Sequence[str],
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    settled: bool = True,
) -> Tuple[Optional[WholeProposal], Optional[List[Sequence[int]]]]:
    """The store's whole proposal and the scheduled drafts when this step verifies exactly its trees, every one
    whole (each request scheduled its placeholders, all of them) and in its order, and (``settled``) the proposal's
    top-K has reached the host; ``(None, None)`` otherwise."""
    whole = store.whole_proposal_of(req_ids, settled)
    if whole is None:
        return None, None
    scheduled = list(map(scheduled_spec_tokens.get, req_ids))
    if not all(scheduled) or _late_uniform_budget(scheduled, (), True) != whole.size:
        return None, None  # (a request without drafts, a cut tree, a known draft: the general path)
    return whole, scheduled


def _take_records(
    store: TreeStore,
    req_ids: Sequence[str],
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    unproposed: Optional[Tuple[int, int]],
) -> Tuple[List[int], List[DraftRecord], List[Sequence[int]], List[bool]]:
    """The rows, records, scheduled drafts and filler flags of the requests with scheduled drafts, their records
    taken from the store. One pass in plain Python lists (a numpy scalar costs ~1 us here, per request); the checks
    after it are whole-batch array operations."""
    rows, records, scheduled, filler = [], [], [], []
    for i, req_id in enumerate(req_ids):
        drafts = scheduled_spec_tokens.get(req_id)
        if not drafts:
            continue
        record = store.take(req_id)
        is_filler = record is None and unproposed is not None and drafts[0] == PLACEHOLDER
        if is_filler:
            record = filler_record(*unproposed, len(drafts))  # whole at what was scheduled: not a cut tree
        elif record is None:
            raise DraftMismatchError(
                f"request {req_id}: {len(drafts)} draft tokens scheduled but no DDTree proposal recorded"
            )
        rows.append(i)
        records.append(record)
        scheduled.append(drafts)
        filler.append(is_filler)
    return rows, records, scheduled, filler


class _UniformStep(NamedTuple):
    """Read-only counts of a step in which each of ``R`` requests verifies a tree of ``b`` drafts."""

    rows: np.ndarray  # [R] 0 .. R - 1
    budgets: np.ndarray  # [R] b
    num_scheduled: np.ndarray  # [R] b + 1
    query_start: np.ndarray  # [R + 1] 0, b + 1, 2 (b + 1), ...
    token_offsets: np.ndarray  # [R + 1] the trees' draft offsets: 0, b, 2 b, ...


def _read_only(*arrays: np.ndarray) -> Tuple[np.ndarray, ...]:
    """``arrays``, write-protected: constants of a step shape, shared by every step of it."""
    for array in arrays:
        array.setflags(write=False)
    return arrays


@functools.lru_cache(maxsize=64)
def _uniform_step(num_reqs: int, budget: int) -> _UniformStep:
    return _UniformStep(
        *_read_only(
            np.arange(num_reqs, dtype=np.int64),
            np.full(num_reqs, budget, dtype=np.int64),
            np.full(num_reqs, budget + 1, dtype=np.int64),
            np.arange(num_reqs + 1, dtype=np.int64) * (budget + 1),
            np.arange(num_reqs + 1, dtype=np.int64) * budget,
        )
    )


def _late_uniform_budget(scheduled: List[Sequence[int]], filler: List[bool], every_request: bool) -> Optional[int]:
    """The drafts' count when every request has placeholder drafts of one count from a proposal (a late step of
    uniform trees); None otherwise. Python-level tests: numpy's per-call cost is most of a batch-1 step here."""
    if not every_request or any(filler):
        return None
    lengths = set(map(len, scheduled))
    if len(lengths) != 1 or 0 in lengths:
        return None
    if set(map(_first_item, scheduled)) != _ONLY_PLACEHOLDERS:  # (C-level loops: ~1 us at batch 32, not ~12)
        return None
    return lengths.pop()


_first_item = operator.itemgetter(0)
_ONLY_PLACEHOLDERS = {PLACEHOLDER}


def _placeholders(scheduled: Sequence[Sequence[int]]) -> np.ndarray:
    return np.fromiter((d[0] == PLACEHOLDER for d in scheduled), dtype=bool, count=len(scheduled))


def ancestor_words(tree_size: int) -> int:
    """32-bit words of one ancestor bitmask row for trees of up to ``tree_size`` nodes."""
    return (tree_size + 31) // 32


def layout_specs(num_rows: int, num_trees: int, num_nodes: int, words: int, conv_window: int) -> ArraySpecs:
    """The arrays :func:`ddtree.verify_layout_into` writes: ``num_trees`` trees of ``num_nodes`` nodes in all,
    in a batch of ``num_rows`` rows."""
    specs = {
        "node_offsets": (np.int32, (num_trees + 1,)),
        "token_index": (np.int64, (num_nodes,)),
        "logit_rows": (np.int64, (num_nodes,)),
        "positions": (np.int64, (num_nodes,)),
        "ancestor_bits": (np.int32, (num_nodes, words)),
        "row_start": (np.int32, (num_rows,)),
    }
    if conv_window > 0:
        specs["conv_index"] = (np.int64, (num_nodes, conv_window + 1))
    return specs


#: Optional outputs of :func:`ddtree.verify_layout_into` beyond the layout: per node (``[T]`` int64) its depth, its
#: tree's root among the step's tokens, its parent as a node of the step, its tree, its index in its tree and its
#: draft token; per draft node (``[T - R]``) its index among the step's tokens and its token (int32).
NODE_OUTPUTS = (
    "depths",
    "root_index",
    "node_parents",
    "node_tree",
    "node_local",
    "node_tokens",
    "draft_step_index",
    "draft_tokens",
)


@functools.lru_cache(maxsize=64)
def plan_specs(
    num_rows: int, num_trees: int, num_nodes: int, words: int, conv_window: int, placeholder_drafts: bool
) -> Mapping[str, Tuple[np.dtype, Tuple[int, ...]]]:
    """Every array :func:`plan_verify` asks ``arrays`` for: the layout's, the tree rows (``batch_index``) and, for
    placeholder drafts, each draft token and its index among the step's tokens. Counts only: the runner lays out an
    upload from them before the trees exist (``launch_gate``).

    One read-only mapping per step shape, the same object every time (a step's shape repeats): the runner keys its
    own additions on it, and the staging recognises it without comparing its items."""
    specs = {
        "batch_index": (np.int64, (num_trees,)),
        **layout_specs(num_rows, num_trees, num_nodes, words, conv_window),
    }
    if placeholder_drafts:
        specs["draft_step_index"] = (np.int64, (num_nodes - num_trees,))
        specs["draft_tokens"] = (np.int32, (num_nodes - num_trees,))
    return types.MappingProxyType(specs)


def _lay_out(
    trees,
    rows,
    proposed_budgets,
    num_reqs,
    num_computed_tokens,
    query_start,
    logit_start,
    conv_window,
    words,
    arrays,
    placeholder_drafts=False,
    num_nodes=None,
):
    """The plan's arrays, written by one Rust call into what ``arrays`` allocates (with ``placeholder_drafts``,
    also every draft token and its index among the step's tokens). ``num_nodes``: the trees' sizes, when the
    caller knows them already (int64)."""
    node_offsets = trees.node_offsets
    if num_nodes is None:
        num_nodes = (node_offsets[1:] - node_offsets[:-1]).astype(np.int64)
    total, num_trees = int(node_offsets[-1]), len(rows)
    if words is None:
        words = ancestor_words(int(num_nodes.max()))
    out = arrays(plan_specs(num_reqs, num_trees, total, words, conv_window, placeholder_drafts))
    batch_index = out.pop("batch_index")
    batch_index[:] = rows
    if num_trees == num_reqs:  # every request verifies a tree: the rows are the requests in order (slices)
        query_starts, computed, logit_starts = query_start[:-1], num_computed_tokens, logit_start[:-1]
    else:
        query_starts = query_start[batch_index]
        computed, logit_starts = num_computed_tokens[batch_index], logit_start[batch_index]
    # The layout's arrays and the per-node ones the caller's allocator added (the runner's device side, among
    # NODE_OUTPUTS): written by the same Rust call.
    ddtree.verify_layout_into(trees, batch_index, computed, query_starts, logit_starts, **out)
    return VerifyPlan(
        batch_index=batch_index,
        trees=trees,
        token_index=out["token_index"],
        logit_rows=out["logit_rows"],
        positions=out["positions"],
        ancestor_bits=out["ancestor_bits"],
        row_start=out["row_start"],
        node_offsets=out["node_offsets"],
        num_nodes=num_nodes,
        query_starts=query_starts,
        num_tokens=int(query_start[-1]),
        proposed_budgets=proposed_budgets,
        conv_index=out.get("conv_index"),
        conv_window=conv_window,
        draft_step_index=out.get("draft_step_index"),
        draft_tokens=out.get("draft_tokens"),
    )


def filler_record(depth: int, width: int, budget: int) -> DraftRecord:
    """A proposal for a request the drafter did not propose for: token ``k`` with log-probability ``-k - 1`` at
    every depth (a valid, deterministic tree), counted as proposed at ``budget``. As wide as the top-K (``width``)
    where that fills ``budget`` nodes at ``depth``; wider where it does not (a small ``ddtree_top_k``): the
    placeholders vLLM scheduled are all verified."""
    while tree_size(budget, width, depth) < budget:
        width += 1  # (at most ceil(budget / depth): depth levels of that many nodes each)
    log_probs = np.broadcast_to(-np.arange(1, width + 1, dtype=np.float32), (depth, width)).copy()
    token_ids = np.broadcast_to(np.arange(width, dtype=np.int32), (depth, width)).copy()
    return DraftRecord(log_probs, token_ids, None, budget=budget)


def tree_token_layout(
    req_ids: Sequence[str], num_scheduled_tokens: np.ndarray, scheduled_spec_tokens: Mapping[str, Sequence[int]]
) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """What a step's tree layout takes from vLLM's counts alone, before any tree is built: ``(batch_index [R_t],
    num_nodes [R_t], token_index [T])`` of the requests with scheduled drafts (each verifies the root and its
    drafts: all its scheduled tokens), the same as :func:`plan_verify`'s (None: no request has drafts)."""
    n = np.asarray(num_scheduled_tokens, dtype=np.int64)[: len(req_ids)]
    rows = np.fromiter((i for i, req_id in enumerate(req_ids) if scheduled_spec_tokens.get(req_id)), dtype=np.int64)
    if rows.shape[0] == 0:
        return None
    if rows.shape[0] == n.shape[0]:  # every request verifies a tree (decodes only): its tokens are all the step's
        return rows, n, np.arange(int(n.sum()), dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(n)])
    num_nodes = n[rows]
    return rows, num_nodes, np.repeat(query_start[rows], num_nodes) + index_within_groups(num_nodes)


class WholeTreeCounts(NamedTuple):
    """:func:`tree_token_layout`'s result for a step in which every request verifies a tree of ``whole`` tokens
    and nothing else is scheduled (read-only arrays, one set per step shape)."""

    rows: np.ndarray  # [R] 0 .. R - 1
    num_nodes: np.ndarray  # [R] whole
    token_index: np.ndarray  # [R * whole] 0 .. R * whole - 1
    whole: int


@functools.lru_cache(maxsize=64)
def _whole_tree_counts(num_reqs: int, whole: int) -> WholeTreeCounts:
    shape = _uniform_step(num_reqs, whole - 1)  # trees of whole - 1 drafts: the same rows and node counts
    (token_index,) = _read_only(np.arange(num_reqs * whole, dtype=np.int64))
    return WholeTreeCounts(shape.rows, shape.num_scheduled, token_index, whole)


def whole_tree_counts(
    num_reqs: int, total: int, num_scheduled_tokens: np.ndarray, scheduled_spec_tokens: Mapping[str, Sequence[int]]
) -> Optional[WholeTreeCounts]:
    """:func:`tree_token_layout` of a step of whole trees of one size, from constants of its shape (None: not such
    a step, or not recognised so; the general function then answers). vLLM lists only scheduled requests, all of
    them in the input batch: ``num_reqs`` entries with drafts are every request."""
    if num_reqs == 0 or total % num_reqs or len(scheduled_spec_tokens) != num_reqs:
        return None
    counts = _whole_tree_counts(num_reqs, total // num_reqs)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)[:num_reqs]
    if not same_values(scheduled, counts.num_nodes) or not all(scheduled_spec_tokens.values()):
        return None
    return counts


def index_within_groups(counts: np.ndarray) -> np.ndarray:
    """``[0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ...]`` (int64)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def top_k_arrays(
    store: TreeStore, req_ids: Sequence[str], records: Sequence[DraftRecord]
) -> Tuple[np.ndarray, np.ndarray]:
    """The records' top-K as ``[R, L, K]`` log-probs and ids: rows of the last settled proposal taken in one gather
    when every record is one of its (a slice when they are its rows in order), else stacked record by record."""
    settled = store.settled
    in_order = store.settled_in_order
    if (
        in_order is not None
        and len(records) == len(in_order[1])
        and all(map(operator.is_, records, in_order[1]))
        and tuple(req_ids) == in_order[0]
    ):
        return settled[1], settled[2]  # the proposal's rows, all of them, in order (the usual step)
    if settled is not None:
        rows, log_probs, token_ids = settled
        if all(rows.get(req_id, (None,))[0] is record for req_id, record in zip(req_ids, records)):
            index = np.fromiter((rows[req_id][1] for req_id in req_ids), dtype=np.int64, count=len(req_ids))
            if index.shape[0] and same_values(index, np.arange(index[0], index[0] + index.shape[0])):
                return log_probs[index[0] : index[0] + index.shape[0]], token_ids[index[0] : index[0] + index.shape[0]]
            return log_probs[index], token_ids[index]
    widths = {r.log_probs.shape[-1] for r in records}
    if len(widths) > 1:
        return _stack_padded(records, max(widths))
    return np.stack([r.log_probs for r in records]), np.stack([r.token_ids for r in records])


def _stack_padded(records: Sequence[DraftRecord], width: int) -> Tuple[np.ndarray, np.ndarray]:
    """The records' top-K stacked at ``width`` candidates: a filler wider than the top-K (a narrow top-K cannot fill
    the placeholders vLLM scheduled) beside proposals, whose extra candidates are ``-inf`` (token 0). A proposal's
    tree at its scheduled size takes none of them: its scheduled size is what its own candidates filled, finite ones
    ranking first (a proposal whose own top-K holds ``-inf`` values, fewer finite drafter logits than K, could
    tie with them; no drafter of a real vocabulary has that)."""
    depth = records[0].log_probs.shape[0]
    log_probs = np.full((len(records), depth, width), -np.inf, dtype=np.float32)
    token_ids = np.zeros((len(records), depth, width), dtype=records[0].token_ids.dtype)
    for r, record in enumerate(records):
        k = record.log_probs.shape[-1]
        log_probs[r, :, :k] = record.log_probs
        token_ids[r, :, :k] = record.token_ids
    return log_probs, token_ids


def _proposed_trees(
    store: TreeStore, req_ids: Sequence[str], records: Sequence[DraftRecord], budgets: np.ndarray
) -> Optional["ddtree.TreeBatch"]:
    """The last proposal's batch when this step verifies exactly its trees, whole and in order (None: build)."""
    last = store.last_batch
    store.last_batch = None  # one verification per proposal
    if last is None or last[0] != tuple(req_ids):
        return None
    whole = all(r.tokens is not None and r.tokens.shape[0] == b for r, b in zip(records, budgets))
    return last[1] if whole else None


def _draft_mismatch(req_ids, records, scheduled_spec_tokens, trees, placeholders) -> DraftMismatchError:
    """The first request whose scheduled drafts are not its rebuilt tree, and why."""
    sizes = np.diff(trees.token_offsets)
    for j, req_id in enumerate(req_ids):
        if sizes[j] != len(scheduled_spec_tokens[req_id]):
            return DraftMismatchError(
                f"request {req_id}: its rebuilt tree has {sizes[j]} draft nodes, "
                f"{len(scheduled_spec_tokens[req_id])} drafts were scheduled"
            )
    for j, (req_id, record) in enumerate(zip(req_ids, records)):
        if placeholders[j]:
            continue  # vLLM holds only the count
        drafts = np.asarray(scheduled_spec_tokens[req_id], dtype=np.int64)
        built, b = record.tokens, drafts.shape[0]
        if built is not None and (b > built.shape[0] or not np.array_equal(drafts, built[:b])):
            return DraftMismatchError(
                f"request {req_id}: scheduled drafts {drafts[:8].tolist()}... are not a prefix of its tree "
                f"{built[:8].tolist()}... ({b} vs {built.shape[0]} tokens)"
            )
        if not np.array_equal(trees.tokens[trees.token_offsets[j] : trees.token_offsets[j + 1]], drafts):
            return DraftMismatchError(f"request {req_id}: rebuilt tree differs from the scheduled drafts")
    return DraftMismatchError("rebuilt trees differ from the scheduled drafts")


@dataclasses.dataclass
class AcceptPlan:
    """The outcome of a verification, in vLLM's terms; the arrays are written by one Rust call
    (:func:`ddtree.acceptance_layout_into`) into what the caller's allocator returned."""

    accepted: "ddtree.AcceptedBatch"
    output_tokens: np.ndarray  # [R_t, width] int32: accepted draft tokens + bonus, -1 padded (vLLM's rows)
    kv_src: np.ndarray  # [M] int64: flat scheduled-token index whose K/V moves ...
    kv_dst: np.ndarray  # [M] int64: ... to this flat scheduled-token index
    # [num_tokens] int64: the target's hidden-state rows in the order the next drafter pass reads them. vLLM's
    # DFlash proposer treats a request's verified rows as a chain (the first accepted + 1 are context, the rest
    # ignored padding); each tree's root and accepted path first, in path order, then its other nodes, gives
    # the drafter exactly the accepted path's hidden states at consecutive positions.
    context_order: np.ndarray
    paths: np.ndarray  # [R_t, P] int32: accepted tree-local nodes, root first, 0 padded (GDN commit)
    path_lengths: np.ndarray  # [R_t] int32
    commit_conv_index: Optional[np.ndarray] = None  # [R_t, w] int64: rows of each new conv history


def accept(
    plan: VerifyPlan,
    node_target_tokens: np.ndarray,
    width: int,
    arrays: Callable[[ArraySpecs], Dict[str, np.ndarray]] = numpy_arrays,
) -> AcceptPlan:
    """Walks the trees with the target's per-node tokens (flat ``[T]``) and lays out what follows.

    ``width`` is the row width of vLLM's ``sampled_token_ids`` (max scheduled
    drafts + 1); accepted paths never exceed it because a request with ``b``
    drafts has no node deeper than ``b`` (a longer one is a ValueError).
    """
    trees = plan.host_trees()
    result = ddtree.accept_trees(trees, np.ascontiguousarray(node_target_tokens, dtype=np.int64))
    out = arrays(acceptance_specs(result, width, plan.num_tokens, plan.conv_window))
    ddtree.acceptance_layout_into(trees, result, plan.query_starts, **out)
    return AcceptPlan(accepted=result, **out)


def acceptance_specs(accepted: "ddtree.AcceptedBatch", width: int, num_tokens: int, conv_window: int) -> ArraySpecs:
    """The arrays :func:`ddtree.acceptance_layout_into` writes for ``accepted``: chain rows of ``width``, a
    step of ``num_tokens`` tokens, GDN commit rows for a conv window of ``conv_window`` (0: none)."""
    num_trees, moves = int(accepted.paths.shape[0]), int(accepted.kv_src.shape[0])
    specs = {
        "output_tokens": (np.int32, (num_trees, width)),
        "kv_src": (np.int64, (moves,)),
        "kv_dst": (np.int64, (moves,)),
        "context_order": (np.int64, (num_tokens,)),
        "paths": (np.int32, tuple(accepted.paths.shape)),
        "path_lengths": (np.int32, (num_trees,)),
    }
    if conv_window > 0:
        specs["commit_conv_index"] = (np.int64, (num_trees, conv_window))
    return specs


def emitted_logit_rows(
    plan: Optional[VerifyPlan], accepted: Optional["ddtree.AcceptedBatch"], last_rows: np.ndarray, width: int
) -> np.ndarray:
    """The logits row each emitted token was sampled from, in vLLM's ``[num_reqs, width]`` output layout.

    Token ``j`` of a tree request comes from node ``paths[j]`` of its accepted path (the root's row for the
    first, the bonus from the last path node's); every other entry -- requests without a tree, and columns
    past a request's emitted tokens, which vLLM discards -- gets the request's last row (``last_rows [R]``,
    vLLM's ``bonus_logits_indices``).
    """
    rows = np.repeat(np.asarray(last_rows, dtype=np.int64)[:, None], width, axis=1)
    if plan is None or accepted is None:
        return rows
    paths = accepted.paths
    offsets = plan.host_trees().node_offsets
    for j, r in enumerate(plan.batch_index):
        path = paths[j][paths[j] >= 0].astype(np.int64)[:width]
        rows[r, : path.shape[0]] = plan.logit_rows[offsets[j] + path]
    return rows


def tree_of_request(plan: Optional[VerifyPlan]) -> Dict[int, int]:
    """Batch row of each request that verifies a tree -> that tree's index in ``plan.trees``."""
    return {} if plan is None else {int(r): j for j, r in enumerate(plan.batch_index)}


def stop_token_rows(
    plan: Optional[VerifyPlan], row_starts: np.ndarray, pending: Sequence[Tuple[int, int, Sequence[int]]]
) -> Tuple[np.ndarray, np.ndarray]:
    """Logits entries to set to -inf for ``min_tokens``: ``(rows, tokens)``, int64.

    ``pending`` holds ``(request index, tokens still to generate before a stop token may end it, stop
    tokens)``. A node at depth ``d`` samples the request's output token ``d`` positions after the next one, so
    its row masks the stop tokens while ``d`` is below that count: exact per node, whatever the branch.
    Requests without a tree have one row (``row_starts[r]``), at depth 0.
    """
    if not pending:  # (the usual step: no request with min_tokens left; the tree index below is per request)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    tree_of = tree_of_request(plan)
    rows, tokens = [], []
    for r, remaining, stops in pending:
        if remaining <= 0 or not stops:
            continue
        j = tree_of.get(r)
        if j is None:
            masked = np.array([row_starts[r]], dtype=np.int64)
        else:
            trees = plan.host_trees()  # (a device-planned step's: built from its top-K on this first read)
            lo, hi = trees.node_offsets[j], trees.node_offsets[j + 1]
            masked = plan.logit_rows[lo:hi][trees.depths[lo:hi] < remaining]
        rows.append(np.repeat(masked, len(stops)))
        tokens.append(np.tile(np.asarray(list(stops), dtype=np.int64), masked.shape[0]))
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(rows), np.concatenate(tokens)


def row_output_tokens(
    plan: Optional[VerifyPlan], outputs: Sequence[Sequence[int]], counts: np.ndarray
) -> List[List[int]]:
    """The output tokens each logits row is conditioned on, for history-dependent penalties.

    A tree node's row follows the request's committed output and then the tokens on its root path (its own
    included); a request without a tree has one row, after its committed output. ``counts[r]`` is request
    ``r``'s number of rows (its tree's nodes).
    """
    tree_of = tree_of_request(plan)
    rows: List[List[int]] = []
    for r, count in enumerate(counts):
        committed = list(outputs[r])
        j = tree_of.get(r)
        if j is None:
            rows.extend([committed] * int(count))
            continue
        trees = plan.host_trees()  # (a device-planned step's: built from its top-K on this first read)
        first, last = trees.node_offsets[j], trees.node_offsets[j + 1]
        parents = trees.parents[first:last]
        tokens = trees.tokens[trees.token_offsets[j] : trees.token_offsets[j + 1]]
        paths: List[List[int]] = [[]]
        for node in range(1, last - first):  # parents come first (pop order)
            paths.append(paths[parents[node]] + [int(tokens[node - 1])])
        rows.extend(committed + path for path in paths)
    return rows


def chain_as_tree_check(output_tokens: np.ndarray) -> np.ndarray:
    """Number of accepted draft tokens per row of a chain-format matrix (for tests and metrics)."""
    valid = output_tokens != PLACEHOLDER
    return valid.sum(axis=1) - 1


def kv_slots(slot_mapping: np.ndarray, src_token: np.ndarray, dst_token: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Cache slots of a move plan given the step's slot mapping (flat token -> slot)."""
    return slot_mapping[src_token], slot_mapping[dst_token]
