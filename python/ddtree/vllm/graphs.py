"""Tree steps under CUDA graphs: persistent tree inputs, dummy trees for capture, commit records per graph, and
graphs of the step's own repeated work.

A CUDA graph replays the kernels it captured with the tensor addresses it captured, and none of the Python
around them. Three things follow for DDTree (``vllm-0.25.1-cudagraphs.md`` in the design notes has the map):

* the per-step tree layout (ancestor bits, each request's first bits row, the CSR node offsets, the GDN conv
  gather index) lives in :class:`TreeStepBuffers`, allocated once and written in place every step, so eager,
  PIECEWISE and FULL steps all read the same addresses;
* a FULL graph of ``N`` whole trees is captured from dummy trees of the real budget staged in those buffers
  (:meth:`TreeStepBuffers.stage_dummy_trees`): the capture records the tree kernels, with the graph's shapes
  (``N`` requests, ``N * (budget + 1)`` tokens);
* the GDN commit after acceptance needs what each layer's verification produced (its conv inputs, keys,
  per-node deltas and log decays); in a replay no Python runs to hand them over, so the tensors recorded at
  capture are kept per graph (:class:`CapturedCommits`), as references that do not own the graph pool's
  memory (a replay rewrites them in place; the commit reads them before any other graph runs).

Around the model's graphs, the step's own small launches repeat with the same shapes from one whole-tree step to
the next: :class:`ShapeGraphs` captures such work once per key and replays it (the GDN commit,
:class:`CommitGraphs`; the device walk, :class:`WalkGraphs`; the runner's plan placement and KV moves).

Torch and the Rust core only (the runner passes vLLM's weak-reference helper in): CI tests it on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

import ddtree
from ddtree.vllm.bounded import keep
from ddtree.vllm.gdn import GdnCommitPlan, GdnTreeStep, PendingCommit
import ddtree.vllm.step
from ddtree.vllm.step import ancestor_words, layout_specs

#: A FULL graph of tree steps: (tokens, trees), vLLM's ``BatchDescriptor.num_tokens`` and ``num_reqs``. A budget
#: schedule's graphs of different tree sizes may share a token count, never both.
GraphKey = Tuple[int, int]


#: Step shapes whose buffer views ``TreeStepBuffers.views`` keeps.
MAX_CACHED_VIEWS = 1024


class TreeStepBuffers:
    """One step's tree layout on the device, at fixed addresses.

    ``max_requests`` trees of up to ``tree_size`` nodes (budget + 1), ``max_tokens`` tree tokens in all;
    ``conv_width`` is the GDN conv's ``W`` (0: no GDN layers).
    """

    def __init__(self, device, max_requests: int, max_tokens: int, tree_size: int, conv_width: int = 0):
        self.device = torch.device(device)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tree_size = tree_size
        self.words = ancestor_words(tree_size)
        self.row_start = torch.full((max_requests,), -1, dtype=torch.int32, device=self.device)
        self.ancestor_bits = torch.zeros((max_tokens, self.words), dtype=torch.int32, device=self.device)
        self.node_offsets = torch.zeros((max_requests + 1,), dtype=torch.int32, device=self.device)
        # The same offsets as int64, for the device walk (``wide_offsets``): at a fixed address, so that a walk graph
        # keyed by its inputs' addresses finds a step placed op by op again (a new tensor a step moved every key).
        self.node_offsets64 = torch.zeros((max_requests + 1,), dtype=torch.int64, device=self.device)
        self._offsets64: Dict[int, torch.Tensor] = {}
        self.conv_index = (
            torch.zeros((max_tokens, conv_width), dtype=torch.int64, device=self.device) if conv_width else None
        )
        # 0 .. max_tokens - 1: the tree tokens' step indices when every scheduled token is a tree token.
        self.step_index = torch.arange(max_tokens, dtype=torch.int64, device=self.device)
        self._leading_step_index: Dict[int, torch.Tensor] = {}
        # views() by step shape: the buffers never move, and a step's shape repeats (four tensor slices were
        # ~20 us of Python a call, once or twice a step).
        self._views: Dict[tuple, Dict[str, torch.Tensor]] = {}

    def load(
        self,
        row_start: torch.Tensor,
        ancestor_bits: torch.Tensor,
        node_offsets: Optional[torch.Tensor] = None,
        conv_index: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        """Copies one step's layout (device tensors) in; returns the buffers' views of it.

        ``row_start`` ``[num_reqs]``; ``ancestor_bits`` ``[T, w]`` with ``w <= words`` (the rest of each row
        is zeroed); ``node_offsets`` ``[R + 1]`` and ``conv_index`` ``[T, W]`` for GDN targets.
        """
        num_reqs, (num_tokens, words) = row_start.shape[0], ancestor_bits.shape
        if num_reqs > self.max_requests or num_tokens > self.max_tokens or words > self.words:
            raise ValueError(
                f"DDTree: a step of {num_reqs} requests and {num_tokens} tree tokens ({words} bit words) exceeds "
                f"the buffers' {self.max_requests} / {self.max_tokens} / {self.words}"
            )
        if conv_index is not None and self.conv_index is None:
            raise ValueError("DDTree: conv_index given, but the buffers were made for a target without GDN")
        num_trees = node_offsets.shape[0] - 1 if node_offsets is not None else None
        views = self.views(num_reqs, num_tokens, num_trees, conv_index is not None)
        views["row_start"].copy_(row_start)
        bits = views["ancestor_bits"]
        bits[:, :words].copy_(ancestor_bits)
        if words < self.words:
            bits[:, words:].zero_()
        if node_offsets is not None:
            views["node_offsets"].copy_(node_offsets)
        if conv_index is not None:
            views["conv_index"].copy_(conv_index)
        return views

    def wide_offsets(self, node_offsets: torch.Tensor) -> torch.Tensor:
        """``node_offsets`` (``[R + 1]``) copied into the int64 buffer; its view, one object per length (so a trees
        object built from it is found again by identity)."""
        count = node_offsets.shape[0]
        view = self._offsets64.get(count)
        if view is None:
            if count > self.node_offsets64.shape[0]:
                raise ValueError(f"DDTree: {count - 1} trees exceed the buffers' {self.max_requests}")
            view = self._offsets64[count] = self.node_offsets64[:count]
        view.copy_(node_offsets)
        return view

    def leading_step_index(self, num_tokens: int) -> torch.Tensor:
        """``step_index[:num_tokens]``, one view per count (at most ``max_tokens`` of them; a slice costs ~2 us of
        Python a step)."""
        view = self._leading_step_index.get(num_tokens)
        if view is None:
            if not 0 <= num_tokens <= self.step_index.shape[0]:
                raise ValueError(f"DDTree: {num_tokens} step tokens exceed the buffers' {self.step_index.shape[0]}")
            view = self._leading_step_index[num_tokens] = self.step_index[:num_tokens]
        return view

    def views(
        self, num_reqs: int, num_tokens: int, num_trees: Optional[int] = None, conv: bool = False
    ) -> Dict[str, torch.Tensor]:
        """The buffers' views for a step of ``num_reqs`` requests and ``num_tokens`` tree tokens in ``num_trees``
        trees: what :meth:`load` returns, known from the counts alone (a step published before its trees are
        built, under asynchronous scheduling, hands these to vLLM's metadata builders; ``load`` fills them)."""
        key = (num_reqs, num_tokens, num_trees, conv)
        views = self._views.get(key)
        if views is None:
            views = {"row_start": self.row_start[:num_reqs], "ancestor_bits": self.ancestor_bits[:num_tokens]}
            if num_trees is not None:
                views["node_offsets"] = self.node_offsets[: num_trees + 1]
            if conv:
                views["conv_index"] = self.conv_index[:num_tokens]
            keep(self._views, key, views, MAX_CACHED_VIEWS)
        return dict(views)  # the caller's own dict; the tensors are the cached views

    def stage_dummy_trees(self, num_trees: int, depth: int, tree_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """Whole trees of ``tree_size`` nodes (default: the buffers', budget + 1) and drafter depth ``depth``, for
        a capture of ``num_trees`` trees.

        Built by the Rust core from a fixed draft distribution, so the captured kernels see valid trees of the
        budget the graph serves (the layout's values are rewritten by every real step before a replay).
        """
        tree_size = self.tree_size if tree_size is None else tree_size
        if not 2 <= tree_size <= self.tree_size:
            raise ValueError(f"DDTree: dummy trees of {tree_size} nodes; the buffers hold 2 to {self.tree_size}")
        budget = tree_size - 1
        width = max(1, -(-budget // depth))  # candidates per position: enough for `budget` nodes
        log_probs = np.broadcast_to(-np.arange(width, dtype=np.float32) - 1.0, (num_trees, depth, width)).copy()
        token_ids = np.broadcast_to(np.arange(width, dtype=np.int64), (num_trees, depth, width)).copy()
        trees = ddtree.build_trees(log_probs, token_ids, budget)
        offsets = trees.node_offsets
        if int(offsets[-1]) != num_trees * tree_size:
            raise RuntimeError(f"DDTree: dummy trees have {int(offsets[-1])} nodes, expected {num_trees} x {tree_size}")
        conv_window = self.conv_index.shape[1] - 1 if self.conv_index is not None else 0
        firsts = offsets[:-1]  # the trees fill the step: each root's token and logits row is its first node
        plan = ddtree.vllm.step.numpy_arrays(
            layout_specs(num_trees, num_trees, int(offsets[-1]), self.words, conv_window)
        )
        ddtree.verify_layout_into(trees, np.arange(num_trees), 0, firsts, firsts, **plan)
        host = {
            name: plan[name] for name in ("row_start", "ancestor_bits", "node_offsets", "conv_index") if name in plan
        }
        return self.load(**{k: torch.from_numpy(v).to(self.device) for k, v in host.items()})


@dataclasses.dataclass
class CapturedCommits:
    """The GDN commit inputs a FULL graph's replay rewrites, by graph."""

    by_graph: Dict[GraphKey, Dict[str, PendingCommit]] = dataclasses.field(default_factory=dict)

    def record(self, graph: GraphKey, step: GdnTreeStep, weak: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keeps the capture's per-layer commit inputs as references that do not own graph-pool memory.

        Owning them would keep every graph's activations alive; a replay writes the same addresses, and the
        commit reads them before any other graph replays.
        """
        self.by_graph[graph] = {
            name: dataclasses.replace(
                pending,
                slots=weak(pending.slots),
                x=weak(pending.x),
                k=weak(pending.k),
                deltas=weak(pending.deltas),
                cum_log_decay=weak(pending.cum_log_decay),
            )
            for name, pending in step.pending.items()
        }
        step.pending.clear()

    def replayed(self, graph: GraphKey) -> Dict[str, PendingCommit]:
        commits = self.by_graph.get(graph)
        if not commits:
            raise RuntimeError(
                f"DDTree: a FULL CUDA graph of {graph[0]} tokens in {graph[1]} trees replayed a tree step, but its "
                "capture recorded no GDN commit inputs"
            )
        return commits


class WalkGraphs:
    """The device walk of a FULL tree step (:func:`ddtree.vllm.device_accept.accept_on_device`) as one CUDA graph
    per step shape and input addresses.

    The walk is ~40 small torch operations whose launches cost the host 1.71 ms per batch-1 step at the
    Qwen3.6-27B shape (``gpu-h200-async-b798afe``). A FULL step's shapes repeat (``N`` whole trees), so the first
    walk of a key runs eagerly, is then captured (capturing runs nothing), and later walks replay it. The trees'
    arrays are views of the plan's upload and the placement graph's outputs, which stay at the same addresses while
    the step shape repeats: a graph keyed by those addresses reads them where they are, and only the target's
    tokens are copied in (one copy, where copying every input took about ten launches). A shape whose inputs keep
    moving gets :attr:`ADDRESS_SETS` graphs, then its walks copy their inputs into the shape's own. The results are
    the graph's outputs, rewritten by its next replay: the step reads them before that (the chain rows are copied
    out, the KV moves, commit and drafter are queued right after the walk). ``capture`` is
    :func:`cuda_graph_capture` on a GPU (tests pass a stand-in).
    """

    #: Input addresses a shape gets its own graph for before its walks copy their inputs instead.
    ADDRESS_SETS = 4
    #: Trees objects remembered with their graph's key (see :meth:`walk`), before the memory starts afresh.
    KNOWN_TREES = 16

    def __init__(self, capture, ring=None):
        self._graphs = ShapeGraphs(capture)
        # The statistics' ``PathRing``, written inside each walk (and so inside its graph); None: not written.
        self.ring = ring
        self._inputs: Dict[tuple, tuple] = {}  # by key: (the graph's target, the trees it reads)
        self._address_sets: Dict[tuple, int] = {}  # by shape: graphs keyed by input addresses
        # By the trees object and the walk's other inputs' shapes: (the key, the trees object itself, so its id
        # is never another object's while remembered).
        self._known: Dict[tuple, tuple] = {}
        # What the last :meth:`target_for` handed out, for the walk that follows it: (trees, walk arguments, the
        # target buffer, the graph's key and trees); None once a walk has taken it.
        self._handed: Optional[tuple] = None
        self.copied_walks = 0  # walks that copied their trees in (inputs that kept moving)
        self.targets_in_place = 0  # walks whose target tokens were already in the graph's own (``target_for``)

    @property
    def replayed(self) -> int:
        return self._graphs.replayed

    def target_for(
        self, trees, rows: int, width: int, path_width: int, num_tokens: int, conv_window: int
    ) -> Optional[torch.Tensor]:
        """The target tokens' buffer (int64 ``[rows]``) of the graph that a :meth:`walk` of ``trees`` with these
        arguments will replay, for the sampler to write its tokens into: the walk then launches no copy of them
        (one launch a step, ~10-20 us of host time behind the engine's deep launch queue). None until a walk has
        found that graph by the trees object (the shape's first steps), or when its target is another shape."""
        args = (width, path_width, num_tokens, conv_window)
        hit = self._known.get((id(trees), *args, torch.int64, (rows,), (1,)))
        if hit is None:
            return None
        own_target = self._inputs[hit[0]][0]
        # The walk that follows, with this buffer as its target, needs no look-up of its own.
        self._handed = (trees, args, own_target, hit)
        return own_target

    def walk(self, trees, target: torch.Tensor, width: int, path_width: int, num_tokens: int, conv_window: int):
        """The walk's outputs (a replay's, or an eager walk's the first time). A trees object seen before with a
        graph that reads it in place (the runner hands the same object while the step shape repeats: its tensors,
        and so their shapes and addresses, cannot have changed) finds its key without reading ~20 tensors'
        metadata (~20 us of Python a step on the H200 host)."""
        from ddtree.vllm.device_accept import accept_on_device

        args = (width, path_width, num_tokens, conv_window)
        handed, self._handed = self._handed, None
        if handed is not None and handed[2] is target and handed[0] is trees and handed[1] == args:
            hit = handed[3]  # (the buffer :meth:`target_for` handed out for this walk: its graph found there)
        else:
            known = (id(trees), *args, target.dtype, tuple(target.shape), target.stride())
            hit = self._known.get(known)
        if hit is not None:
            own_target, own_trees = self._inputs[hit[0]]
            if target is own_target:  # the sampler wrote its tokens there (``target_for``): no copy to launch
                self.targets_in_place += 1
            else:
                own_target.copy_(target)
            return self._graphs.run(hit[0], lambda: accept_on_device(own_trees, own_target, *args, ring=self.ring))
        fields = [f.name for f in dataclasses.fields(trees)]
        inputs = [getattr(trees, name) for name in fields]
        # (An optional field, e.g. no step serial, is None: part of the key as such.)
        shape = args + tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in [*inputs, target])
        key = shape + tuple(0 if t is None else t.data_ptr() for t in inputs)
        entry = self._inputs.get(key)
        address_sets = self._address_sets.get(shape, 0)
        if entry is None and address_sets < self.ADDRESS_SETS:
            self._address_sets[shape] = address_sets + 1
            entry = self._inputs[key] = (target.clone(), trees)  # the trees read in place
        elif entry is None:  # inputs that keep moving: copied into the shape's own
            self.copied_walks += 1
            key = shape + ("copied",)
            entry = self._inputs.get(key)
            if entry is None:
                own = [None if t is None else t.clone() for t in inputs]
                entry = self._inputs[key] = (target.clone(), dataclasses.replace(trees, **dict(zip(fields, own))))
            else:
                for name, given in zip(fields, inputs):
                    if given is not None:
                        getattr(entry[1], name).copy_(given)
        if key[-1] != "copied":  # a graph that reads these tensors in place: the object finds it from now on
            keep(self._known, known, (key, trees), self.KNOWN_TREES)
        own_target, own_trees = entry
        own_target.copy_(target)
        return self._graphs.run(key, lambda: accept_on_device(own_trees, own_target, *args, ring=self.ring))


def cuda_graph_capture(device, pool=None) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Captures ``work`` (nothing runs) into a CUDA graph on ``device``; returns its replay. ``pool``: a memory pool
    (``torch.cuda.graph_pool_handle()``) the graphs share; None: each graph its own."""

    def capture(work: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: a launch from another thread of the process (vLLM's output thread) must not
        # invalidate it.
        with cache_kept(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            work()
        return graph.replay

    return capture


def timed_replays(capture, seconds: Dict[str, float], name: str):
    """``capture`` whose graphs' replays add their host seconds to ``seconds[name]``.

    A replay (``cudaGraphLaunch``) returns once its work is queued; when the GPU's launch queue is full it waits for
    room, so a GPU-bound step shows up as host time inside the replays. Kept apart, ddtree's timed parts split
    into the host's own work and the time its launches took (``graph_launch_ms_per_verify_step``)."""

    def timed_capture(work: Callable[[], None]) -> Callable[[], None]:
        replay = capture(work)

        def timed_replay() -> None:
            start = time.perf_counter()
            replay()
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return timed_replay

    return timed_capture


@contextlib.contextmanager
def cache_kept():
    """``torch.cuda.graph``'s entry without its cache releases.

    Entering ``torch.cuda.graph`` empties the caching allocator (``torch.cuda.empty_cache``) and the pinned host
    memory cache (``torch._C._host_emptyCache``), for a capture at start-up. ddtree captures its step graphs while
    serving, on a step shape's first run (``ShapeGraphs``): there the steps after a capture would allocate their
    device tensors with ``cudaMalloc`` and their pinned buffers with ``cudaHostAlloc`` again, both slow and
    synchronising, and ``auto`` meets many step shapes (budget x batch size). vLLM's own capture skips the
    allocator release for the same reason (``vllm/compilation/cuda_graph.py``, ``gc_disable``). The device
    synchronisation on entry stays. Patched on the modules while the capture lasts (it launches nothing)."""
    saved = [(torch.cuda, "empty_cache", torch.cuda.empty_cache)]
    if hasattr(torch._C, "_host_emptyCache"):
        saved.append((torch._C, "_host_emptyCache", torch._C._host_emptyCache))
    for module, name, _ in saved:
        setattr(module, name, _keep_cache)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _keep_cache() -> None:
    """Stands in for the cache releases during :func:`cache_kept`."""


class ShapeGraphs:
    """Work that repeats with the same shapes and tensor addresses, as one CUDA graph per key.

    The first call of a key runs the work eagerly (it compiles kernels and allocates) and then captures it
    (capturing runs nothing); later calls of that key replay the graph. ``work`` returns its outputs (a dict, or
    None); after a capture they are the graph's own tensors, rewritten by every replay of that key, so a caller
    reads them before it runs the key again. ``capture`` is :func:`cuda_graph_capture` on a GPU (tests pass a
    stand-in that returns the work as its replay).
    """

    #: Keys run for the first time, over every instance in the process: such a run compiles, allocates and captures
    #: (which synchronizes), tens of ms where a step takes a few. ``auto``'s step timer leaves out a step that raised
    #: it (``runner._ddtree_auto_step``): on the pair, budgets met late (15 at probes, 63 at 11-32 requests) kept
    #: such steps as their medians and ``auto`` took budget 15 at batch 32 (``gpu-h200-pair-landed-ae204db``).
    first_runs = 0
    #: Captures that ran out of device memory, over every instance (the runner's summary reports them): ddtree
    #: captures while serving, beside a KV cache sized to fill the memory vLLM was given.
    capture_failures = 0
    #: Graphs captured, over every instance, and the device memory their captures reserved (the growth of the caching
    #: allocator's reserved bytes across each capture: a graph keeps its own memory pool, so these add up with the
    #: step shapes an engine meets; outside the KV-cache budget vLLM planned at start-up).
    captures = 0
    capture_reserved_bytes = 0

    def __init__(self, capture):
        self._capture = capture
        self._graphs: Dict[tuple, tuple] = {}
        self._eager: set = set()  # keys whose capture ran out of memory: their work runs launch by launch
        self.replayed = 0

    def has(self, key) -> bool:
        """Whether ``key``'s graph exists (its next :meth:`run` replays, capturing nothing: no synchronization)."""
        return key in self._graphs

    def run(self, key, work: Callable[[], Optional[Dict[str, torch.Tensor]]]):
        """``work``'s outputs for ``key``: replayed, or (first call) from ``work`` run as is. A capture that runs out
        of device memory leaves its key to run eagerly from then on (slower, exact), with a warning: the engine
        keeps serving."""
        entry = self._graphs.get(key)
        if entry is not None:
            replay, outputs = entry
            replay()
            self.replayed += 1
            return dict(outputs)
        if key in self._eager:
            return work()
        ShapeGraphs.first_runs += 1
        result = work()
        outputs: Dict[str, torch.Tensor] = {}

        def recorded() -> None:
            outputs.update(work() or {})

        reserved = _reserved_bytes()
        try:
            replay = self._capture(recorded)
        except torch.cuda.OutOfMemoryError as exc:
            self._eager.add(key)
            ShapeGraphs.capture_failures += 1
            # (A child of vLLM's logger, which has the handler, without importing vLLM here.)
            logging.getLogger("vllm.ddtree.graphs").warning(
                "DDTree: capturing a step graph ran out of device memory (%s); that step shape runs launch by launch "
                "from now on (slower, exact). A lower gpu_memory_utilization leaves room for ddtree's graphs.",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return result
        ShapeGraphs.captures += 1
        ShapeGraphs.capture_reserved_bytes += max(_reserved_bytes() - reserved, 0)
        self._graphs[key] = (replay, outputs)
        return result


class DraftTopKGraphs:
    """The drafter's top-K as one CUDA graph per number of rows (``DDTREE_TOPK_GRAPHS``, experimental).

    After vLLM's drafter pass the proposer computes the drafter's logits, their top-K and the packed
    ``[rows, 2K]`` tensor for the host (:func:`ddtree.kernels.draft_top_k.pack_top_k`): a few launches, one of them
    a Triton kernel whose Python launch alone costs tens of microseconds, on the host's path of every step. Here
    the sampled hidden states (a new tensor each step: vLLM gathers them) are copied into the graph's own, and
    one replay runs the rest. ``top_k_of(hidden, host)`` is the eager computation (a dict of outputs; ``host``: the
    late trees' pinned rows, which the kernel writes too, a graph per target); a graph's outputs are rewritten by
    its next replay, which the proposer's step consumes before (the packed top-K reaches the host in the same
    ``propose``).

    The graphs share one memory pool (``capture`` is made with one), and a step whose logits would exceed
    ``max_logit_bytes`` runs eagerly: a graph keeps its temporaries' memory reserved for good, and at a 248k
    vocabulary the logits of 32 requests x 15 positions are ~240 MB, which vLLM's memory planning counted once,
    as a transient.
    """

    def __init__(self, capture, vocab: int, itemsize: int, max_logit_bytes: int = 64 << 20):
        self._graphs = ShapeGraphs(capture)
        self._inputs: Dict[tuple, torch.Tensor] = {}  # by input shape: the graph's own hidden states
        self.max_rows = max(0, max_logit_bytes // max(1, vocab * itemsize))
        self.eager_steps = 0  # steps above max_rows

    @property
    def replayed(self) -> int:
        return self._graphs.replayed

    def run(self, hidden: torch.Tensor, top_k_of: Callable[..., Dict[str, torch.Tensor]], host=None):
        """``top_k_of(hidden, host)``'s outputs; ``host`` (late trees' pinned rows, or None) is part of a graph's
        key: a graph's kernel writes where its capture was told to."""
        if hidden.shape[0] > self.max_rows:
            self.eager_steps += 1
            return top_k_of(hidden, host)
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        own = self._inputs.get(key)
        if own is None:
            own = self._inputs[key] = torch.empty_like(hidden)
        own.copy_(hidden)
        target = None if host is None else (host.data_ptr(), tuple(host.shape))
        return self._graphs.run(("draft top-k",) + key + (target,), lambda: top_k_of(own, host))


def _reserved_bytes() -> int:
    """The caching allocator's reserved device bytes (0 without CUDA)."""
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


class CommitGraphs:
    """The GDN commit after a FULL tree step as one CUDA graph per FULL graph.

    After a FULL replay the commit is two Triton launches per GDN layer (96 at Qwen3.6-27B), each paying
    Python's launch cost. Its inputs already sit at fixed addresses: what the FULL graph's capture recorded per
    layer (:class:`CapturedCommits`), the layers' state caches and the tree offsets in :class:`TreeStepBuffers`;
    the accepted paths are copied into buffers owned here. The first commit of a graph runs eagerly (it compiles
    the kernels and commits); the graph is then captured (capturing runs nothing) and replayed from the next step
    of that graph on. ``capture`` is :func:`cuda_graph_capture` on a GPU (tests pass a stand-in).
    """

    def __init__(self, device, max_requests: int, path_width: int, conv_window: int, capture):
        self.device = torch.device(device)
        self.paths = torch.zeros((max_requests, path_width), dtype=torch.int32, device=self.device)
        self.path_lengths = torch.ones((max_requests,), dtype=torch.int32, device=self.device)
        self.conv_index = torch.zeros((max_requests, conv_window), dtype=torch.int64, device=self.device)
        self._graphs = ShapeGraphs(capture)

    @property
    def replayed(self) -> int:
        return self._graphs.replayed

    def commit(
        self,
        graph: GraphKey,
        commits: Dict[str, PendingCommit],
        plan: GdnCommitPlan,
        commit_layer,
        in_place: bool = False,
        kv_moves: Optional[Tuple[torch.Tensor, torch.Tensor, Callable]] = None,
    ) -> None:
        """Commits every layer of a step the FULL graph ``graph`` replayed (``commit_layer(pending, plan)`` per
        layer).

        ``in_place``: the plan's tensors stay where they are from step to step (a walk graph's outputs, rewritten in
        place by each replay): a graph keyed by their addresses reads them there, and the three copies into this
        object's buffers (three launches on the host's path) are skipped. A walk keeps at most a few address sets
        per shape (``WalkGraphs.ADDRESS_SETS``), so such graphs stay few. ``kv_moves`` (in place only): ``(src,
        dst, move)``, the step's K/V moves (the walk's outputs too) recorded in the same graph as ``move(src,
        dst)``: one replay for the whole commit."""
        if in_place:
            tensors = (plan.node_offsets, plan.paths, plan.path_lengths, plan.conv_index)
            key = (graph, tuple(t.data_ptr() for t in tensors), tuple(plan.paths.shape))
            if kv_moves is not None:
                key += (kv_moves[0].data_ptr(), kv_moves[1].data_ptr(), kv_moves[0].shape[0])

            def commit_in_place() -> None:
                if kv_moves is not None:
                    kv_moves[2](kv_moves[0], kv_moves[1])
                for pending in commits.values():
                    commit_layer(pending, plan)

            self._graphs.run(key, commit_in_place)
            return
        if kv_moves is not None:
            raise ValueError("DDTree: K/V moves join only a commit that reads the walk's outputs in place")
        num_requests, path_width = plan.paths.shape
        if num_requests > self.paths.shape[0] or path_width != self.paths.shape[1]:
            raise ValueError(
                f"DDTree: a commit of {num_requests} paths of width {path_width} does not fit the commit graphs' "
                f"{self.paths.shape[0]} x {self.paths.shape[1]}"
            )
        self.paths[:num_requests].copy_(plan.paths)
        self.path_lengths[:num_requests].copy_(plan.path_lengths)
        self.conv_index[:num_requests].copy_(plan.conv_index)
        fixed = GdnCommitPlan(
            node_offsets=plan.node_offsets,
            paths=self.paths[:num_requests],
            path_lengths=self.path_lengths[:num_requests],
            conv_index=self.conv_index[:num_requests],
        )

        def work() -> None:
            for pending in commits.values():
                commit_layer(pending, fixed)

        self._graphs.run(graph, work)
