"""DDTree's V1 GPU model runner: vLLM's runner plus the tree steps.

Subclass of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` installed by
:class:`ddtree.vllm.worker.DDTreeWorker`. Per step (synchronous scheduling, the defaults with one GPU):

``_update_states``      drop the tree records of finished/preempted requests.
``_prepare_input_ids``  vLLM's, without scattering the last step's placeholder drafts under
                        asynchronous scheduling (the tree placement writes every draft).
``_prepare_inputs``     after vLLM's own: wait for the last proposal's top-K, build the
                        scheduled trees and their verification plan
                        (:func:`ddtree.vllm.step.plan_verify`), write the tree tokens
                        where vLLM put placeholder drafts, overwrite the tree tokens'
                        positions with ``start + depth`` (slot mapping already computed
                        from the flat positions, so node j's K/V lands at slot start+j),
                        publish the tree-attention inputs.
``execute_model``       vLLM's, then clear the tree-attention inputs.
``_sample``             vLLM calls our rejection sampler
                        (:class:`ddtree.vllm.sampler.DDTreeRejectionSampler`), which
                        walks the trees on the device; then move the accepted nodes'
                        K/V into consecutive slots in every target attention layer,
                        commit the GDN state and hand the drafter the accepted-path
                        row order.
``_bookkeeping_sync``   vLLM's, reading the chain rows' early copy (not waiting for the
                        drafter).
``take_draft_token_ids`` placeholder drafts of each tree's size (the proposer did not wait
                        for its top-K).

Under asynchronous scheduling (``DDTREE_ASYNC_SCHEDULING``, on by default with one GPU) ``_prepare_inputs``
publishes the step from vLLM's counts only and ``_preprocess``, after vLLM's metadata builds, does the rest of the
plan. A step of whole trees that replays a FULL graph goes further (``DDTREE_LAUNCH_AHEAD``): ``_preprocess``
queues a gate, the plan's upload and its placement without waiting, vLLM launches the forward behind them, and
``_model_forward`` then builds the trees into the queued upload and releases the gate (``launch_gate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import types
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from ddtree.vllm.log import get_logger
from ddtree.vllm.streams import current_stream
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.utils import record_function_or_nullcontext
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ddtree.vllm import context
from ddtree.vllm.attention import DDTreeAttentionBackend
from ddtree.vllm.context import PublishedStep, TreeAttentionInputs
from ddtree.kernels.kv_moves import apply_kv_moves_indexed, kv_move_index
from ddtree.vllm import device_accept, gdn_metadata, grammar
from ddtree.vllm.counts import PathRing
from ddtree.vllm.device_plan import MAX_TREE_SIZE as MAX_DEVICE_TREE_SIZE
from ddtree.vllm.device_plan import DevicePlanner, fits_far_from_the_end
from ddtree.vllm.min_tokens import MinTokensRequests, Pending
from ddtree.vllm.patches import vllm_below
from ddtree.vllm.proposer import tensor_parallel_rank
from ddtree.vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    DDTreeConfig,
    async_scheduling_lacks,
    large_batch_advice,
    lone_row_advice,
    budget_description,
    commit_graphs_enabled,
    commit_in_place_enabled,
    device_accept_enabled,
    device_plan_mode,
    device_plan_lacks,
    device_plan_subsets_enabled,
    late_trees_enabled,
    launch_ahead_enabled,
    launch_ahead_mode,
    mixed_walk_graphs_enabled,
    precapture_commits,
    precapture_enabled,
    schedule_tree_graphs,
    smaller_budgets,
    step_graphs_enabled,
    tree_size,
)
from ddtree.vllm.bounded import keep
from ddtree.vllm.gdn import GdnCommitPlan, GdnTreeStep, commit_boundaries, commit_layer, commit_pending
from ddtree.vllm.mamba_align import boundary_prefixes
from ddtree.vllm.graphs import (
    CapturedCommits,
    CommitGraphs,
    GraphKey,
    ShapeGraphs,
    TreeStepBuffers,
    WalkGraphs,
    cuda_graph_capture,
    timed_replays,
)
from ddtree.vllm import launch_gate
from ddtree.vllm.launch_gate import StreamGate
from ddtree.vllm.staging import StepStaging
from ddtree.vllm.stats import DDTreeStats
from ddtree.vllm.step import (
    NODE_OUTPUTS,
    PLACEHOLDER,
    AcceptPlan,
    DeferredTrees,
    TreeStore,
    VerifyPlan,
    accept,
    cut_trees,
    numpy_arrays,
    plan_specs,
    plan_verify,
    prefill_beside_trees,
    same_values,
    take_device_plannable,
    take_device_subset,
    tree_token_layout,
    whole_tree_counts,
)
from ddtree.vllm.what_if import PeriodicLog, log_interval
from ddtree.vllm import auto_budget
from ddtree.vllm.auto_budget import AutoBudget, StepTimer

logger = get_logger(__name__)


@dataclasses.dataclass
class EarlyLaunch:
    """A step queued before its trees exist: the gate's ticket, and the device side of the upload and placement
    queued behind it (``_ddtree_queue_early``), for ``_ddtree_prepare`` to finish once the trees are built."""

    gate: StreamGate
    ticket: int
    staging: StepStaging  # the plan's, its upload queued behind the gate
    late_step: tuple  # _ddtree_prepare's arguments
    gpu: Dict[str, torch.Tensor]
    placed: Dict[str, torch.Tensor]
    released: bool = False

    def release(self) -> None:
        """Lets the GPU copy the staging and run what follows (once; later calls do nothing); the staging's views
        are its own again."""
        if self.released:
            return
        self.released = True
        self.staging.data_written()
        self.gate.release(self.ticket)


def shallow_copy(obj):
    """``copy.copy`` of a plain object (a ``VerifyPlan`` template) without its pickle protocol: 0.6 us against 2.0
    on the development CPU, once per device-planned step."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def serve_builtin_logitsprocs(input_batch, vllm_config, device, pin_memory: bool) -> None:
    """Gives the persistent batch every vLLM built-in logits processor (instances it already has are kept).

    Under any speculative config vLLM's ``build_logitsprocs`` builds the min_tokens processor only: it refuses
    ``min_p`` and ``logit_bias`` there. A ddtree engine admits both (``patches`` 2b) and its sampler reads
    their state (``LogitBiasLogitsProcessor.biases``, ``MinPLogitsProcessor.min_p_cpu``) from the batch's
    processors; without them both settings would be silently ignored. Call before any request is added.
    """
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    current = list(input_batch.logitsprocs.all)
    have = {type(p) for p in current}
    missing = [cls(vllm_config, device, pin_memory) for cls in BUILTIN_LOGITS_PROCESSORS if cls not in have]
    if not missing:
        return
    input_batch.logitsprocs = LogitsProcessors(current + missing)
    input_batch.sampling_metadata = input_batch._make_sampling_metadata()


#: Slots of the device ring of accepted paths (``ddtree.vllm.counts``): the host copies the ring, and records an
#: event, once every this many device-walked steps. Four slots made it every fourth step; an event's record alone
#: cost ~0.028 ms of a batch-1 step's host work on an H100 inside the engine (``gpu-h100-pair-to-host-b5124aa``'s
#: `defer: copy` piece), so the copy and its record are spread over 16 steps (the statistics lag 16 steps more at
#: most; the ring is 16 x (max_num_seqs + 1) rows of depth + 2 int32 on the device and twice that pinned).
PATH_RING_SLOTS = 16

#: ... with ``ddtree_budget: "auto"``: its probes alternate two budgets every few observed steps and close after 16
#: (``auto_budget``), so the observed steps must arrive a few at a time, as they happen; 16 at once would put a whole
#: probe in one burst and measure nothing.
AUTO_PATH_RING_SLOTS = 4

#: Tree counts and sizes of steps with a prefill beside their trees that get walk graphs (DDTREE_MIXED_WALK_GRAPHS):
#: such a step's tree count is any number of running requests, and each shape's graphs (up to
#: ``WalkGraphs.ADDRESS_SETS`` + 1, ~2 MB each) are kept for the engine's life; the shapes after these walk op by op.
MAX_MIXED_WALK_SHAPES = 8

#: Entries of the runner's caches by step shape (``_calc_spec_decode_metadata``, ``_ddtree_staged_plan_specs``)
#: before one starts afresh: a batch of whole trees repeats one shape, mixed steps' shapes vary without bound.
MAX_KEPT_SHAPES = 64

#: The runner's plan layouts by step shape (``_ddtree_staged_plan_specs``): ``(specs, full specs, runner names)``.
_STAGED_PLAN_SPECS: Dict[tuple, tuple] = {}


def fill_plan_extras(extras: Dict[str, np.ndarray], plan: VerifyPlan, total: int) -> None:
    """Fills the runner's arrays that ride in the plan's upload and that the Rust layout does not write (see
    ``_ddtree_plan_arrays``); the plan's ``step_serial`` is set already."""
    if "step_serial" in extras:  # where the device walk puts the step's path rows (``PathRing``)
        extras["step_serial"][0] = plan.step_serial
    if "tree_query_starts" in extras:  # the device walk's (DDTREE_DEVICE_ACCEPT)
        extras["tree_query_starts"][:] = plan.query_starts
    if "other_index" in extras:
        extras["other_index"][:] = other_tokens(total, plan.token_index)


def other_tokens(total: int, token_index: np.ndarray) -> np.ndarray:
    """The step's tokens that are not tree tokens, in order."""
    keep = np.ones(total, dtype=bool)
    keep[token_index] = False
    return np.flatnonzero(keep)


#: From this vLLM on (0.33 read; the versions between 0.25 and 0.33 unread, taken as 0.33), its runner marks a
#: decode that got no drafts as a spec decode of 0 drafts (``num_decode_draft_tokens`` 0, not -1), so that its GDN
#: builder applies the chain's accepted-token offset to the state; 0.25.1 marks it -1.
DRAFTLESS_SPEC_ROWS_FROM = (0, 26, 0)


def unmark_draftless_spec_rows(num_decode_draft_tokens: np.ndarray) -> bool:
    """A ddtree engine's spec decodes are its tree rows, the requests with drafts (a tree has at least one): a row
    of 0 drafts is set back to -1 (a plain decode) in place, so vLLM's GDN builder reads it from the request's one
    state slot as a decode and counts only tree tokens as spec tokens (``_ddtree_check_spec_rows``). Returns
    whether a row changed."""
    draftless = num_decode_draft_tokens == 0
    if not draftless.any():
        return False
    num_decode_draft_tokens[draftless] = -1
    return True


def gdn_conv_window(model_config) -> int:
    """``W - 1`` of a hybrid target's GDN conv, from its HF config."""
    text = model_config.hf_text_config
    width = getattr(text, "linear_conv_kernel_dim", None)
    if not isinstance(width, int) or width < 1:
        raise RuntimeError("DDTree: hybrid target without linear_conv_kernel_dim (only GDN hybrids are supported)")
    return width - 1


class DDTreeGPUModelRunner(GPUModelRunner):
    # ``ddtree_budget: "auto"`` only (set in __init__): the live budgets and the timer of their steps.
    _ddtree_auto: Optional[AutoBudget] = None
    _ddtree_step_timer: Optional[StepTimer] = None
    _ddtree_first_runs_at_start = 0  # ShapeGraphs.first_runs when the timed step started
    _ddtree_precapture = False  # DDTREE_PRECAPTURE (read at start-up)
    _ddtree_precapture_commits = False  # DDTREE_PRECAPTURE=all
    _ddtree_profiling_graph_memory = False  # inside vLLM's profile_cudagraph_memory (no start-up captures)
    _ddtree_step_serial = 0  # the next planned step's number (``PathRing``)
    _ddtree_unmark_draftless = False  # vLLM >= DRAFTLESS_SPEC_ROWS_FROM with a hybrid target (set at start-up)
    _ddtree_plan: Optional[VerifyPlan] = None  # the step's verification (None: no tree step)

    # Off until __init__ sets them (the CPU tests build runners without it).
    _ddtree_gate: Optional[StreamGate] = None
    _ddtree_gate_landed_steps = False
    _ddtree_early: Optional[EarlyLaunch] = None
    # DDTREE_DEVICE_PLAN: steady steps' trees built on the device; off until __init__ makes it. What start-up
    # decided, for the summary: "on", or "off: " and why (an engine that cannot run it is not an error under auto).
    _ddtree_device_planner: Optional[DevicePlanner] = None
    _ddtree_device_plan_state = "off: not decided"
    _ddtree_device_subsets = False  # DDTREE_DEVICE_PLAN_SUBSETS, read with the planner
    _ddtree_mixed_walk_graphs = False  # DDTREE_MIXED_WALK_GRAPHS, read with the step graphs' switch
    _ddtree_mixed_walk_shapes: Optional[Set[Tuple[int, int]]] = None  # ... the (tree count, size)s given graphs
    _ddtree_draftless_logits_indices: Optional[torch.Tensor] = None  # a step without drafts: its logits rows' tokens
    _ddtree_last_device_trees: Optional[tuple] = None  # (views token, offsets, trees) of the last device-planned step

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        data = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if data is None:
            raise RuntimeError("DDTreeGPUModelRunner needs additional_config['ddtree'] (set by the ddtree plugin)")
        self.ddtree_cfg = DDTreeConfig.from_dict(data)
        self._ddtree_plan: Optional[VerifyPlan] = None
        self._ddtree_accept: Optional[AcceptPlan] = None
        self._ddtree_accept_gpu: Optional[Dict[str, torch.Tensor]] = None
        self._ddtree_flat_positions: Optional[torch.Tensor] = None
        # The step's GDN layout, kept from publication to the commit after acceptance (None: no tree step).
        self._ddtree_gdn_step: Optional[GdnTreeStep] = None
        self._ddtree_proposed = False
        self.ddtree_stats = DDTreeStats(self.ddtree_cfg.draft_len or 0, smaller_budgets(self.ddtree_cfg))
        # What ddtree makes on a KV cache (its layers' caches, the commit inputs FULL captures record, the K/V-move
        # and commit graphs): none yet, made when first needed, dropped with the cache (``initialize_kv_cache``).
        self._ddtree_forget_kv_cache()
        # One host-to-device copy per phase and step (the plan's arrays; the acceptance's).
        self._ddtree_plan_staging = self._ddtree_new_staging()
        self._ddtree_accept_staging = self._ddtree_new_staging()
        # Hybrid GDN targets: W - 1 of the conv (0: attention-only target).
        self._ddtree_conv_window = gdn_conv_window(self.model_config) if self.model_config.is_hybrid else 0
        # vLLM 0.33 counts a decode without drafts as a spec decode of 0 drafts (its chain reads the last state at
        # an accepted-token offset); a ddtree request keeps one state slot, so such a decode is a plain one.
        self._ddtree_unmark_draftless = bool(self._ddtree_conv_window) and not vllm_below(DRAFTLESS_SPEC_ROWS_FROM)
        # Prefix caching with a hybrid target (mamba cache mode "align"): boundary commits (``mamba_align``; their
        # block size is the state groups' own, read from the KV-cache config), and the state groups' layers (made
        # at the first boundary commit).
        self._ddtree_aligned_states = bool(
            self._ddtree_conv_window and getattr(self.cache_config, "mamba_cache_mode", "none") == "align"
        )
        self._ddtree_state_group_layers: Optional[List[Tuple[int, List[str]]]] = None
        # The boundary commits' prefixes and destination blocks: one pinned copy on the steps that have them.
        self._ddtree_boundary_staging = self._ddtree_new_staging() if self._ddtree_aligned_states else None
        # The tree layout at fixed addresses (CUDA graphs read them), and what FULL graphs' captures recorded.
        tree_size = self.ddtree_cfg.budget + 1
        self._ddtree_buffers = TreeStepBuffers(
            self.device,
            self.max_num_reqs,
            self.max_num_tokens,
            tree_size,
            self._ddtree_conv_window + 1 if self._ddtree_conv_window else 0,
        )
        # The GDN commit of FULL steps as CUDA graphs (made at the first commit after each FULL graph, when the
        # accepted paths' width is known); DDTREE_COMMIT_GRAPHS=0 commits layer by layer. Checked here, at start-up.
        self._ddtree_commit_graphs_on = commit_graphs_enabled()
        self._ddtree_commit_in_place = commit_in_place_enabled()  # DDTREE_COMMIT_IN_PLACE
        # The device walk, the plan's device side and the KV moves of FULL steps as CUDA graphs (DDTREE_STEP_GRAPHS;
        # each made at the first step of its shape).
        self._ddtree_step_graphs_on = step_graphs_enabled()
        # ... and the walk of a step with a prefill beside whole trees of one size (DDTREE_MIXED_WALK_GRAPHS), over
        # the scheduler's token budget (``max_num_tokens``): its shapes are then the trees' alone.
        self._ddtree_mixed_walk_graphs = self._ddtree_mixed_walk_graphs_wanted(self.compilation_config.cudagraph_mode)
        self._ddtree_precapture = precapture_enabled()  # DDTREE_PRECAPTURE: those of whole-tree steps at start-up
        self._ddtree_precapture_commits = precapture_commits()  # ... and the commit's (DDTREE_PRECAPTURE=all)
        on_gpu = self.device.type == "cuda"
        # The accepted paths of device-walked steps, written by the walk into a device ring the host reads every
        # PATH_RING_SLOTS steps (``ddtree.vllm.counts``); ``_ddtree_step_serial`` (from 0) numbers the steps that
        # place rows there.
        self._ddtree_counts = self._ddtree_path_ring()
        self._ddtree_walk_graphs = WalkGraphs(self._ddtree_capture("walk"), self._ddtree_counts) if on_gpu else None
        # The plan's device side (the KV moves after a graphed walk: ``_ddtree_forget_kv_cache``).
        self._ddtree_plan_graphs = ShapeGraphs(self._ddtree_capture("plan")) if on_gpu else None
        self._ddtree_walk_replayed = False  # this step's device walk replayed its graph
        # The trees walked on the device (DDTREE_DEVICE_ACCEPT; the benches toggle it in-process for an A/B) and
        # the accepted counts of such steps, read once their copies to the host have landed.
        tensor_parallel_size = self.parallel_config.tensor_parallel_size
        self._ddtree_device_accept = device_accept_enabled(tensor_parallel_size=tensor_parallel_size)
        # What the trees say about the chain and smaller budgets, logged on vLLM's statistics interval (rank 0 only).
        self._ddtree_what_if_log = PeriodicLog(log_interval()) if tensor_parallel_rank() == 0 else None
        # Requests with min_tokens, counted from the engine's token counts (vLLM's processor is wrong for trees
        # under asynchronous scheduling: ``ddtree.vllm.min_tokens``).
        self._ddtree_min_tokens = MinTokensRequests()
        # Asynchronous scheduling (DDTREE_ASYNC_SCHEDULING, on by default with one GPU): the step is published from
        # vLLM's counts in _prepare_inputs (its own upload), and its trees are built in _preprocess, after vLLM's metadata builds.
        self._ddtree_count_staging = self._ddtree_new_staging()
        # vLLM's spec-decode metadata by its inputs' bytes (``_calc_spec_decode_metadata``).
        self._ddtree_spec_metadata: Dict[tuple, tuple] = {}
        self._ddtree_trees_by_tensors: Dict[tuple, device_accept.DeviceTrees] = {}
        self._ddtree_late_step: Optional[tuple] = None
        self._ddtree_early_token_index: Optional[np.ndarray] = None
        # DDTREE_LAUNCH_AHEAD: the gate a step of whole trees queues its forward behind (None: off, or no
        # asynchronous scheduling) and the step queued so (set in _preprocess, finished in _model_forward).
        self._ddtree_gate = self._ddtree_make_gate()
        self._ddtree_gate_landed_steps = launch_ahead_mode() == "always"  # gate also when the drafter has landed
        self._ddtree_early: Optional[EarlyLaunch] = None
        # Late trees (DDTREE_LATE_TREES; the benches toggle it in-process for an A/B): the proposer defers the
        # tree build to the next verification; and, with the device walk, the step's chain rows travel to the host
        # ahead of the drafter (``ddtree_output_to_host``), so vLLM's bookkeeping does not wait for the drafter.
        self._ddtree_late_trees = late_trees_enabled(tensor_parallel_size=tensor_parallel_size)
        self._ddtree_output_host: Optional[torch.Tensor] = None
        self._ddtree_output_landed = None
        self._ddtree_output_early: Optional[tuple] = None
        # This step: the tokens of each tree when all running requests verify whole trees of one size (a FULL
        # graph may replay it; 0: not such a step), and which FULL graph, (tokens, trees), replayed it.
        self._ddtree_whole_tree_tokens = 0
        self._ddtree_full_graph: Optional[GraphKey] = None
        # FULL graphs of a budget schedule's smaller trees, (tokens per tree, trees): set with vLLM's graph keys.
        self._ddtree_schedule_graphs: Set[Tuple[int, int]] = set()
        self._ddtree_in_dummy_run = False
        # ``ddtree_budget: "auto"``: the live budget of each batch size (``auto_budget``) and its step timer.
        if self.ddtree_cfg.auto:
            self._ddtree_auto = AutoBudget(self.ddtree_cfg.budgets, self.max_num_reqs)
            self._ddtree_auto.needs_scheduler = bool(self.use_async_scheduling)
            auto_budget.publish(self._ddtree_auto)
            self.ddtree_stats.auto = self._ddtree_auto
            self._ddtree_step_timer = StepTimer()
            self._ddtree_auto.period_trace = self._ddtree_step_timer.trace
        if self.speculative_config is not None and hasattr(self, "drafter"):
            from ddtree.vllm.proposer import DDTreeProposer
            from ddtree.vllm.sampler import DDTreeRejectionSampler

            self.drafter = DDTreeProposer(vllm_config, device, self, self.ddtree_cfg)
            self.drafter.runner = self
            self.rejection_sampler = DDTreeRejectionSampler(self)
            from vllm.utils.torch_utils import PIN_MEMORY

            serve_builtin_logitsprocs(self.input_batch, vllm_config, self.device, PIN_MEMORY)
            if self.use_async_scheduling:
                self._ddtree_check_async(self.drafter.top_k)
            self._ddtree_device_planner = self._ddtree_make_device_planner()
        logger.info(
            "DDTree: budget %s, drafter depth %s, top-K %s; tree walk on the %s (DDTREE_DEVICE_ACCEPT), trees built "
            "at %s (DDTREE_LATE_TREES), %s scheduling (DDTREE_ASYNC_SCHEDULING)",
            budget_description(self.ddtree_cfg),
            self.ddtree_cfg.draft_len,
            getattr(getattr(self, "drafter", None), "top_k", None),
            "device" if self._ddtree_device_accept else "host",
            "the next verification" if self._ddtree_late_trees else "proposal",
            "asynchronous" if self.use_async_scheduling else "synchronous",
        )
        if not self._ddtree_commit_in_place:
            logger.info(
                "DDTree: commit graphs copy a replayed walk's paths, K/V moved apart (DDTREE_COMMIT_IN_PLACE=0)"
            )
        advice = lone_row_advice(self.ddtree_cfg)
        if advice:
            logger.info("DDTree: %s", advice)
        advice = large_batch_advice(self.ddtree_cfg, self.max_num_reqs, self.model_config.get_hidden_size())
        if advice:
            logger.warning("DDTree: %s", advice)

    def _ddtree_make_device_planner(self) -> Optional[DevicePlanner]:
        """DDTREE_DEVICE_PLAN: the device side of device-planned steps, or None (``0``; or ``auto`` where the engine
        lacks a prerequisite or no budget fits the device's trees, said in the log); ``1`` is refused at start-up,
        with what is missing, where a prerequisite is off."""
        mode = device_plan_mode()
        if mode == "0":
            self._ddtree_device_plan_state = "off: DDTREE_DEVICE_PLAN=0"
            return None
        lacking = device_plan_lacks(
            bool(self.use_async_scheduling),
            self._ddtree_late_trees,
            self._ddtree_device_accept,
            self._ddtree_step_graphs_on,
            self.device.type == "cuda",
        )
        if lacking and mode == "1":
            raise RuntimeError("DDTree: DDTREE_DEVICE_PLAN=1 needs " + "; ".join(lacking))
        if lacking:
            return self._ddtree_device_plan_off(
                "needs " + "; ".join(lacking), "the device plan needs " + "; ".join(lacking)
            )
        if mode == "auto" and not self._ddtree_precapture:
            # Start-up's precapture is where its kernels first run (and a failure there falls back to the host
            # plan); without it they would first run while serving, where a failure fails the step.
            return self._ddtree_device_plan_off(
                "DDTREE_PRECAPTURE=0 (its kernels are checked at start-up's)", "the device plan needs DDTREE_PRECAPTURE"
            )
        if mode == "auto" and all(b + 1 > MAX_DEVICE_TREE_SIZE for b in self.ddtree_cfg.budgets):
            return self._ddtree_device_plan_off(
                f"every budget exceeds {MAX_DEVICE_TREE_SIZE} nodes a tree",
                f"budgets {list(self.ddtree_cfg.budgets)} exceed the device plan's {MAX_DEVICE_TREE_SIZE} nodes a tree",
            )
        self._ddtree_device_plan_state = "on"
        drafter = self.drafter
        logger.info("DDTree: steady steps' trees built and laid out on the device (DDTREE_DEVICE_PLAN=%s)", mode)
        self._ddtree_device_subsets = device_plan_subsets_enabled()
        if not self._ddtree_device_subsets:
            logger.info(
                "DDTree: steps of some of a proposal's requests planned on the host (DDTREE_DEVICE_PLAN_SUBSETS=0)"
            )
        too_big = [b for b in self.ddtree_cfg.budgets if b + 1 > MAX_DEVICE_TREE_SIZE]
        if too_big:
            logger.info(
                "DDTree: budgets %s exceed the device plan's %d nodes a tree: their steps are planned on the host",
                too_big,
                MAX_DEVICE_TREE_SIZE,
            )
        return DevicePlanner(
            self.device,
            self.max_num_reqs,
            drafter.draft_len,
            drafter.top_k,
            self._ddtree_conv_window,
            self._ddtree_buffers.words,
        )

    def _ddtree_make_gate(self) -> Optional[StreamGate]:
        """The launch gate, under asynchronous scheduling with DDTREE_LAUNCH_AHEAD on and a driver that has stream
        waits (otherwise None, said in the log)."""
        if not self.use_async_scheduling or not launch_ahead_enabled():
            return None
        missing = launch_gate.probe(self.device)
        if missing is not None:
            logger.info("DDTree: forwards are launched after their trees (DDTREE_LAUNCH_AHEAD): %s", missing)
            return None
        return StreamGate(self.device)

    def _ddtree_check_async(self, top_k: int) -> None:
        """What asynchronous scheduling needs (``config.async_scheduling_lacks``), checked again with the drafter's
        depth and top-K resolved (at start-up the user may have given neither)."""
        late_device_walk = self._ddtree_device_accept and self._ddtree_late_trees
        lacking = async_scheduling_lacks(late_device_walk, self.ddtree_cfg, top_k)
        if lacking:
            raise RuntimeError("DDTree under asynchronous scheduling needs " + "; ".join(lacking))

    def ddtree_budget_for(self, num_requests: int) -> int:
        """The budget of the trees ``num_requests`` drafting requests propose: ``auto``'s live choice, else the
        configured budget or schedule."""
        if self._ddtree_auto is not None:
            return self._ddtree_auto.budget_for(num_requests)
        return self.ddtree_cfg.budget_for(num_requests)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _update_states(self, scheduler_output):
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if gone and hasattr(self, "drafter"):
            self.drafter.store.discard(gone)
        self._ddtree_min_tokens.discard(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            if params is not None and params.min_tokens:
                self._ddtree_min_tokens.add(new.req_id, params.min_tokens, params.all_stop_token_ids)
        with record_function_or_nullcontext("vllm: _update_states"):
            return super()._update_states(scheduler_output)

    # vLLM's preparation of a step, split into profiler ranges (on with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): the
    # GPU-idle time under "gpu_model_runner: preprocess" is charged to the part the host was in.
    def _build_attention_metadata(self, *args, **kwargs):
        with record_function_or_nullcontext("vllm: _build_attention_metadata"):
            return super()._build_attention_metadata(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        """vLLM's, its host time kept as ``forward launch`` (``vllm_host_ms_per_verify_step``; 1.2 ms per batch-1
        step at the Qwen3.6-27B shape, ``gpu-h200-27b-launch-ahead-632c917``), then, for a step queued ahead of its
        trees (``_ddtree_queue_early``), the trees and the gate's release: the GPU ran through that launch idle
        before (``gpu-h200-27b-shape-768591a``)."""
        early, self._ddtree_early = self._ddtree_early, None
        start = time.perf_counter()
        try:
            output = super()._model_forward(*args, **kwargs)
        except BaseException:
            if early is not None:
                early.release()  # no trees will come: the GPU must not wait for them
            raise
        finally:
            seconds = self.ddtree_stats.vllm_host_seconds
            seconds["forward launch"] = seconds.get("forward launch", 0.0) + time.perf_counter() - start
        if early is not None:
            # The forward is queued behind the gate: now the trees, and the gate's release.
            self._ddtree_settle_and_prepare(early.late_step, early)
        return output

    def _preprocess(self, *args, **kwargs):
        late, self._ddtree_late_step = self._ddtree_late_step, None
        stale, self._ddtree_early = self._ddtree_early, None
        if stale is not None:  # queued by a step that never reached its forward: let the GPU go
            stale.release()
        if late is not None and not self._ddtree_plan_on_device(late):
            # Timed with the plan: queueing the early launch is the step's host work too.
            with self.ddtree_stats.timed("plan"), self.ddtree_stats.detail("plan: early launch"):
                queued = self._ddtree_queue_early(late)
            if not queued:
                # Asynchronous scheduling: the trees arrive now, after vLLM's metadata builds and before the input
                # ids are embedded; the wait is for the drafter of the step before, queued ahead on the GPU.
                self._ddtree_settle_and_prepare(late)
        with record_function_or_nullcontext("vllm: _preprocess"):
            return super()._preprocess(*args, **kwargs)

    def _ddtree_settle_and_prepare(self, late: tuple, early: Optional[EarlyLaunch] = None) -> None:
        try:
            with record_function_or_nullcontext("ddtree: wait for the drafter's top-K"):
                self.drafter.store.settle()
            with self.ddtree_stats.timed("plan"), self.ddtree_stats.detail("plan: host plan"):
                self._ddtree_prepare(*late, early=early)
        finally:
            if early is not None:
                early.release()  # a no-op when _ddtree_prepare released it (the usual case)

    def _ddtree_plan_on_device(self, late: tuple) -> bool:
        """DDTREE_DEVICE_PLAN: a steady step (every request verifies its last proposal's tree, whole, in the
        proposal's order, far from ``max_model_len``, of at most ``device_plan.MAX_TREE_SIZE`` nodes) whose
        placement graph exists is planned on the device (``device_plan``): the host neither waits for the drafter's
        top-K nor builds trees. False: the step is planned on the host, as without it."""
        planner = self._ddtree_device_planner
        if planner is None:
            return False
        if not self._ddtree_step_graphs_on or self._ddtree_plan_graphs is None:
            return False
        stats = self.ddtree_stats
        size = self._ddtree_whole_tree_tokens
        if not size:  # (a prefill beside the trees, or trees of several sizes: cut, or a schedule's mixed budgets)
            stats.device_plan_declined("not whole trees of one size")
            return False
        scheduler_output, _, _, _, num_reqs = late
        if not planner.serves(num_reqs, size):
            stats.device_plan_declined("tree size or request count")
            return False
        if getattr(scheduler_output, "has_structured_output_requests", False):
            # The grammar masks read the trees at once: the host builds the ones the GPU verifies.
            stats.device_plan_declined("structured outputs")
            return False
        with stats.timed("plan"):  # (the tests too: a declined step's are its plan's host work)
            with stats.detail("plan: device checks"):
                whole, rows = self._ddtree_device_plannable(scheduler_output, num_reqs, size)
            if whole is None:
                return False
            self._ddtree_device_prepare(whole, num_reqs, size, scheduler_output.total_num_scheduled_tokens, rows)
        return True

    def _ddtree_device_plannable(self, scheduler_output, num_reqs: int, size: int):
        """``(whole, rows)``: the step's proposal records taken for the device plan (``rows``: a subset step's rows of
        the kept top-K, else None), or ``(None, None)`` when the step goes to the host plan (near the end of the
        context, other requests or trees, top-K not kept), the reason counted."""
        planner = self._ddtree_device_planner
        limit = min(self.max_model_len, getattr(self, "effective_drafter_max_model_len", self.max_model_len))
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        if not fits_far_from_the_end(computed, size, planner.draft_len, limit):
            self.ddtree_stats.device_plan_declined("near max_model_len")
            return None, None
        req_ids = self.input_batch.req_ids[:num_reqs]
        spec = scheduler_output.scheduled_spec_decode_tokens
        whole = take_device_plannable(self.drafter.store, req_ids, spec, top_k_kept=planner.holds)
        if whole is not None:
            return whole, None
        subset = None
        if self._ddtree_device_subsets:
            subset = take_device_subset(self.drafter.store, req_ids, spec, planner.kept_for, planner.rows_in_kept)
        if subset is None:
            # The kept top-K is another proposal's (or none: a drafter pass that kept none), or this step's requests
            # are not that proposal's, whole and in its order (or, with subsets, some of them), each its whole tree.
            kept = planner.kept_for is not None
            self.ddtree_stats.device_plan_declined("not the kept proposal's requests" if kept else "top-K not kept")
            return None, None
        return subset

    def _ddtree_device_prepare(self, whole, num_reqs: int, size: int, total: int, rows=None) -> None:
        """The device-planned step: the shape's constants and the step's serial uploaded, then one graph (per step
        shape) of the tree build, the layout into the upload's device views and the placement; the plan object is
        the shape's, with this step's serial and its trees deferred to the host's first read. ``rows``: a subset
        step's rows of the kept top-K (``take_device_subset``), uploaded with it; None: the kept proposal whole."""
        stats = self.ddtree_stats
        with stats.detail("plan: device template"):
            template = self._ddtree_device_template(num_reqs, size, total)[0]
            published, self._ddtree_early_token_index = self._ddtree_early_token_index, None
            if published is not None and not same_values(template.token_index, published):
                raise RuntimeError(
                    "DDTree: a device-planned step's tokens differ from the counts it was published with"
                )
            if self._ddtree_conv_window > 0:
                self._ddtree_check_spec_rows(template, num_reqs)
        serial = self._ddtree_step_serial
        self._ddtree_step_serial = serial + 1
        gpu, placed = self._ddtree_device_upload_and_place(num_reqs, size, total, serial, rows)
        stats.device_plan_subset_steps += rows is not None
        with stats.detail("plan: device bookkeeping"):
            self._ddtree_device_plan_object(template, serial, whole, gpu, placed)

    def _ddtree_device_plan_object(self, template: VerifyPlan, serial: int, whole, gpu, placed) -> None:
        """The device-planned step's plan object: the shape's template with this step's serial, trees deferred to the
        host's first read, and the upload's and placement's device tensors."""
        planner = self._ddtree_device_planner
        plan = shallow_copy(template)
        plan.step_serial = serial
        plan.deferred_trees = DeferredTrees(self.drafter.store, whole, planner.draft_len)
        plan.logit_rows_gpu = gpu["logit_rows"]
        plan.batch_index_gpu = gpu["batch_index"]
        plan.device_trees = self._ddtree_device_trees_of_step(gpu, placed["node_offsets"])
        self._ddtree_flat_positions = placed["flat_positions"]
        self._ddtree_plan = plan
        self.ddtree_stats.late_tree_steps += 1
        self.ddtree_stats.device_plan_steps += 1

    def _ddtree_device_upload_and_place(self, num_reqs: int, size: int, total: int, serial: int, rows=None):
        """A device-planned step's upload (the shape's constants, written into the staging when its buffer may
        hold other bytes there: another layout, or another upload since a device-planned one; and ``serial``, which
        the device's serial then takes) and its graph; returns the upload's device views and the placement's
        outputs. Right after a device-planned step of its shape, with nothing uploaded and no host-planned step
        since, nothing is uploaded: the device holds the constants and the serial already
        (``DevicePlanner.resumes``). A subset step (``rows``) uploads its rows every time, in a layout of its own (so
        a graph of its own)."""
        planner = self._ddtree_device_planner
        staging = self._ddtree_plan_staging
        with self.ddtree_stats.detail("plan: device upload"):
            gpu = self._ddtree_device_upload(num_reqs, size, total, serial, rows)
        key = (staging.layout_key(), total, "device plan")
        work = functools.partial(self._ddtree_device_place, gpu, total, num_reqs, size)
        with self.ddtree_stats.detail("plan: device graph"):
            placed = self._ddtree_plan_graphs.run(key, work)
        if rows is None:
            planner.planned(num_reqs, size, staging, serial)
        else:  # its rows are this step's: the next step uploads its own layout
            planner.not_resumable()
        return gpu, placed

    def _ddtree_device_upload(self, num_reqs: int, size: int, total: int, serial: int, rows=None):
        """The device-planned step's upload (see :meth:`_ddtree_device_upload_and_place`); its device views."""
        planner = self._ddtree_device_planner
        staging = self._ddtree_plan_staging
        if rows is None and planner.resumes(num_reqs, size, staging, serial):
            gpu = staging.device_views()
            self.ddtree_stats.device_plan_resumed_steps += 1
        else:
            # (Pieces inside the piece: a batch-32 upload cost ~0.3-0.5 ms, ``gpu-h100-pair-stream-223b38b``.)
            detail = self.ddtree_stats.detail
            with detail("plan: device upload: layout"):
                constants = self._ddtree_device_template(num_reqs, size, total)[1]
                words, window = self._ddtree_buffers.words, self._ddtree_conv_window
                specs = plan_specs(num_reqs, num_reqs, total, words, window, True)
                staged = self._ddtree_staged_plan_specs(specs, total, window > 0, rows is not None)
                views = staging.host_arrays(staged[0])
            with detail("plan: device upload: fill"):
                if planner.constants_stale(staging):
                    for name, view in views.items():
                        if name in constants:  # (a subset layout's row index is the step's own, below)
                            view[...] = constants[name]
                views["step_serial"][0] = serial
                if rows is not None:
                    views["proposal_rows"][...] = rows
            with detail("plan: device upload: copy"):
                gpu = staging.upload_host()
                planner.uploaded_constants(staging)
                planner.serial.copy_(gpu["step_serial"])  # (the graph takes the step's serial from the device's)
        return gpu

    def _ddtree_device_place(self, gpu: Dict[str, torch.Tensor], total: int, num_reqs: int, size: int):
        """The device-planned step's device side (captured as one graph): the trees built and laid out into the
        upload's views, then :meth:`_ddtree_place_plan` as for a host plan."""
        self._ddtree_device_planner.build_and_lay_out(gpu, num_reqs, size)
        return self._ddtree_place_plan(gpu, total, True)

    def _ddtree_device_template(self, num_reqs: int, size: int, total: int) -> Tuple[VerifyPlan, Dict[str, np.ndarray]]:
        """A step shape's plan and staged arrays, made once from filler trees of that shape through the host plan's
        own path (so every array a device-planned step uploads is laid out as the host plan lays it out): what does
        not depend on the trees is every such step's; what does is written over on the device."""
        templates = self._ddtree_device_planner.templates
        known = templates.get((num_reqs, size))
        if known is not None:
            return known
        hybrid = self._ddtree_conv_window > 0
        staged: Dict[str, np.ndarray] = {}
        extras: Dict[str, np.ndarray] = {}

        def allocate(specs):
            full_specs, runner_names = self._ddtree_staged_plan_specs(specs, total, hybrid)
            staged.update(numpy_arrays(full_specs))
            views = dict(staged)
            for name in runner_names:
                extras[name] = views.pop(name)
            return views

        plan = self._ddtree_filler_plan(num_reqs, size, allocate)
        fill_plan_extras(extras, plan, total)
        # Not a filler step's: a device-planned step's trees are its proposal's, on the device.
        plan.trees = plan.top1_tokens = plan.filler_mask = None
        for array in (*vars(plan).values(), *staged.values()):  # shared by every step of the shape
            if isinstance(array, np.ndarray):
                array.setflags(write=False)
        entry = (plan, staged)
        return keep(templates, (num_reqs, size), entry, MAX_KEPT_SHAPES)

    def _ddtree_queue_early(self, late: tuple) -> bool:
        """DDTREE_LAUNCH_AHEAD: for a step of whole trees that replays a FULL graph whose placement graph exists,
        queues the gate, the plan's upload (of a layout fixed by the counts) and the placement's replay, without
        waiting for the drafter; vLLM then launches the forward behind them. False: the step is prepared now."""
        gate, graphs = self._ddtree_gate, self._ddtree_plan_graphs
        whole = self._ddtree_whole_tree_tokens
        if gate is None or graphs is None or not self._ddtree_step_graphs_on or not whole:
            return False
        if self._ddtree_full_graph is None:  # PIECEWISE or eager steps run Python in the forward: no gate there
            return False
        if self.drafter.store.has_landed():
            # The GPU is done with the drafter: nothing to overlap the tree build with. Gated anyway, the test pair's
            # steps were ~1 ms slower at batch 1 and 8 (``gpu-h200-pair-launch-ahead-632c917``);
            # DDTREE_LAUNCH_AHEAD=always gates them still, for tests of the gate on such a pair.
            self.ddtree_stats.landed_before_launch_steps += 1
            if not self._ddtree_gate_landed_steps:
                return False
        scheduler_output, _, _, _, num_reqs = late
        total = scheduler_output.total_num_scheduled_tokens
        staging = self._ddtree_plan_staging
        # A whole-tree step: every request verifies one tree of ``whole`` tokens, all of them placeholders.
        specs = plan_specs(num_reqs, num_reqs, total, self._ddtree_buffers.words, self._ddtree_conv_window, True)
        staging.host_arrays(self._ddtree_staged_plan_specs(specs, total, self._ddtree_conv_window > 0)[0])
        key = (staging.layout_key(), total, True)
        if not graphs.has(key):  # its first step captures (which synchronizes): prepared now
            return False
        ticket = gate.queue()  # on the current stream, where the copy, the placement and the forward follow
        gpu = staging.upload_ahead()
        placed = graphs.run(key, functools.partial(self._ddtree_place_plan, gpu, total, True))
        self._ddtree_early = EarlyLaunch(gate, ticket, staging, late, gpu, placed)
        self.ddtree_stats.early_launch_steps += 1
        return True

    def _prepare_input_ids(self, scheduler_output, *args, **kwargs):
        """vLLM's, without its scatter of the last proposal's drafts under asynchronous scheduling.

        vLLM copies each continuing request's drafts into the input ids on the GPU through index lists of every
        scheduled draft (8 x 256 at batch 8), turned into tensors, uploaded, gathered and scattered: 0.17 ms at batch
        8 and 0.68 ms at batch 32 of host work on this repository's CPU for the tensors alone (the lists, ~0.05 and
        0.2 ms, are still built: the roots' indices come from the same loop). For ddtree those drafts are
        placeholders, and the tree placement (``_ddtree_place_plan``) writes every draft position of every tree
        before the forward, so only the roots (the tokens sampled last step) are needed from vLLM here."""
        if self.input_batch.prev_sampled_token_ids is None or not scheduler_output.scheduled_spec_decode_tokens:
            return super()._prepare_input_ids(scheduler_output, *args, **kwargs)
        drafts, self._draft_token_ids = self._draft_token_ids, None
        try:
            return super()._prepare_input_ids(scheduler_output, *args, **kwargs)
        finally:
            self._draft_token_ids = drafts

    def _calc_spec_decode_metadata(self, num_draft_tokens: np.ndarray, cu_num_scheduled_tokens: np.ndarray):
        """vLLM's, with its index tensors kept on the device for inputs seen before.

        vLLM builds five index arrays from the step's draft counts, uploads each (a pinned copy and a transfer
        launch apiece) and gathers the drafts from the input ids: ~15% of ddtree's share of vLLM's input
        preparation on the H200 host (py-spy, ``gpu-h200-pyspy-d81d125``; 63 drafts a request). Its result depends
        on those two arrays alone, besides the drafts it gathers, and a batch of whole trees repeats them step after
        step; so the tensors are kept by the arrays' bytes, and a repeat gathers the drafts only (one launch, from
        the positions kept with them). Nothing reads them but to index: vLLM's own result, bit for bit."""
        key = (num_draft_tokens.dtype.str, num_draft_tokens.tobytes(), cu_num_scheduled_tokens.dtype.str,
               cu_num_scheduled_tokens.tobytes())  # fmt: skip
        kept = self._ddtree_spec_metadata.get(key)
        if kept is None:
            metadata = super()._calc_spec_decode_metadata(num_draft_tokens, cu_num_scheduled_tokens)
            draft_positions = metadata.logits_indices[metadata.target_logits_indices + 1]
            keep(self._ddtree_spec_metadata, key, (metadata, draft_positions), MAX_KEPT_SHAPES)
            return metadata
        metadata, draft_positions = kept
        return dataclasses.replace(
            metadata,
            draft_token_ids=self.input_ids.gpu[draft_positions],
            num_draft_tokens=list(metadata.num_draft_tokens),  # the caller's own list
        )

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        with record_function_or_nullcontext("vllm: _prepare_inputs"):
            prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        # vLLM 0.25 returns (logits_indices, spec_decode_metadata); 0.33 adds max_num_sampled_tokens: returned as is.
        self._ddtree_prepare_inputs(scheduler_output, num_scheduled_tokens, *prepared[:2])
        return prepared

    def _ddtree_prepare_inputs(self, scheduler_output, num_scheduled_tokens, logits_indices, spec_decode_metadata):
        """ddtree's part of the step's input preparation, after vLLM's: the step's trees planned (or, under
        asynchronous scheduling, published from the counts for the late plan)."""
        self._ddtree_plan = None
        self._ddtree_accept = None
        self._ddtree_flat_positions = None
        self._ddtree_whole_tree_tokens = 0
        self._ddtree_full_graph = None
        self._ddtree_late_step = self._ddtree_early_token_index = None
        context.withdraw()
        self._ddtree_gdn_step = None
        # A step without drafts keeps its logits rows' token indices: ddtree samples it when a request is seeded.
        self._ddtree_draftless_logits_indices = logits_indices if spec_decode_metadata is None else None
        if spec_decode_metadata is None:
            return
        num_reqs = self.input_batch.num_reqs
        spec = scheduler_output.scheduled_spec_decode_tokens
        if (
            self._ddtree_unmark_draftless
            and len(spec) < num_reqs  # (a request without drafts: none in the usual step)
            and unmark_draftless_spec_rows(self.num_decode_draft_tokens.np[:num_reqs])
        ):
            self.num_decode_draft_tokens.copy_to_gpu()  # (vLLM queued its copy already; no reader of it in 0.33)
        if self._ddtree_conv_window and scheduler_output.scheduled_new_reqs:
            self._ddtree_clear_fresh_states(scheduler_output.scheduled_new_reqs, spec)
        if self.use_async_scheduling:
            with self.ddtree_stats.timed("plan"), self.ddtree_stats.detail("plan: publish counts"):
                published = self._ddtree_publish_counts(scheduler_output, num_scheduled_tokens, num_reqs)
            if published:
                self._ddtree_late_step = (
                    scheduler_output,
                    num_scheduled_tokens,
                    logits_indices,
                    spec_decode_metadata,
                    num_reqs,
                )
            return
        # Late trees: the last proposal's top-K is waited for here, after vLLM's scheduling and input preparation
        # ran while the drafter did (a no-op otherwise).
        with record_function_or_nullcontext("ddtree: wait for the drafter's top-K"):
            self.drafter.store.settle()
        with self.ddtree_stats.timed("plan"), self.ddtree_stats.detail("plan: host plan"):
            self._ddtree_prepare(scheduler_output, num_scheduled_tokens, logits_indices, spec_decode_metadata, num_reqs)

    def _ddtree_prepare(
        self,
        scheduler_output,
        num_scheduled_tokens,
        logits_indices,
        spec_decode_metadata,
        num_reqs,
        early: Optional[EarlyLaunch] = None,
    ):
        """Builds the step's trees and plan, uploads and places it and publishes it (or, published from the counts
        under asynchronous scheduling, fills what was published). ``early``: the upload and placement are queued
        already, behind a gate released here once the plan is written into the upload's pinned buffer."""
        total = scheduler_output.total_num_scheduled_tokens
        hybrid = self._ddtree_conv_window > 0
        extras: Dict[str, np.ndarray] = {}  # the runner's own arrays in the same upload (filled below)
        plan = plan_verify(
            self.drafter.store,
            self.input_batch.req_ids[:num_reqs],
            self.input_batch.num_computed_tokens_cpu[:num_reqs],
            num_scheduled_tokens,
            scheduler_output.scheduled_spec_decode_tokens,
            conv_window=self._ddtree_conv_window,
            words=self._ddtree_buffers.words,
            arrays=lambda specs: self._ddtree_plan_arrays(specs, total, hybrid, extras),
            # Placeholders where the drafter did not run verify a filler tree: asynchronous scheduling gives them to
            # every decoding request; vLLM pads a request's first decode with them in any scheduling (0.25 beside
            # running requests; 0.33 also after a prefix hit that leaves one token).
            unproposed=(self.drafter.draft_len, self.drafter.top_k),
        )
        published, self._ddtree_early_token_index = self._ddtree_early_token_index, None
        if plan is None:
            if published is not None:
                raise RuntimeError("DDTree: a step published with trees verifies none (a bug)")
            return
        if hybrid:
            self._ddtree_check_spec_rows(plan, num_reqs)
        plan.step_serial, self._ddtree_step_serial = self._ddtree_step_serial, self._ddtree_step_serial + 1
        fill_plan_extras(extras, plan, total)
        late = plan.draft_tokens is not None
        self.ddtree_stats.late_tree_steps += late
        if published is not None:  # published from the counts: the step's whole-tree size is known already
            whole = self._ddtree_whole_tree_tokens
        else:
            whole = self._ddtree_is_whole_tree_step(plan.num_nodes, num_reqs, total)
        if early is not None:
            early.release()  # the GPU copies the plan now, then places it and runs the forward queued behind it
            gpu, placed = early.gpu, early.placed
        else:
            gpu = self._ddtree_plan_staging.upload_host()
            placed = self._ddtree_place(gpu, total, late, whole)
        self._ddtree_flat_positions = placed["flat_positions"]
        if published is not None:
            # Published from the counts before vLLM built the metadata (the views `load` just filled).
            if not same_values(plan.token_index, published):
                raise RuntimeError("DDTree: the trees' tokens differ from the counts the step was published with")
        else:
            layout = self._ddtree_buffers.views(
                int(gpu["row_start"].shape[0]),
                int(gpu["ancestor_bits"].shape[0]),
                int(gpu["node_offsets"].shape[0]) - 1 if "node_offsets" in gpu else None,
                "conv_index" in gpu,
            )
            self._ddtree_publish(
                layout, num_reqs, total, gpu["token_index"], gpu.get("other_index"), int(plan.batch_index.shape[0])
            )
            self._ddtree_whole_tree_tokens = whole
        plan.logit_rows_gpu = gpu["logit_rows"]
        plan.batch_index_gpu = gpu["batch_index"]
        if "node_parents" in gpu:
            plan.device_trees = self._ddtree_device_trees(gpu, placed["node_offsets"])
        self._ddtree_plan = plan

    def _ddtree_device_trees_of_step(self, gpu: Dict[str, torch.Tensor], node_offsets: torch.Tensor):
        """:meth:`_ddtree_device_trees` of a device-planned step, whose views are the plan staging's: when they and
        the placement's offsets are the last such step's (a repeated step shape), its trees, found by identity
        without reading a dozen tensors' ids (~2 us of a batch-1 step's host work on a development CPU)."""
        views = self._ddtree_plan_staging.views_token()
        last = self._ddtree_last_device_trees
        if last is not None and last[0] is views and last[1] is node_offsets:
            return last[2]
        trees = self._ddtree_device_trees(gpu, node_offsets)
        self._ddtree_last_device_trees = (views, node_offsets, trees)  # (held: the identities stay theirs)
        return trees

    def _ddtree_device_trees(self, gpu: Dict[str, torch.Tensor], node_offsets: torch.Tensor):
        """The step's trees for the device walk: one object per set of tensors. A repeated step shape hands the
        same tensors (the upload's views, the placement graph's outputs), so it gets the same object, which the
        walk graphs recognise by identity (``WalkGraphs.walk``) instead of reading every tensor's metadata."""
        tensors = (
            *(gpu[name] for name in device_accept.NODE_ARRAYS),
            gpu["depths"],
            node_offsets,
            gpu["tree_query_starts"],
            gpu["token_index"],
            gpu["ancestor_bits"],
            gpu.get("step_serial"),
        )
        key = tuple(map(id, tensors))  # (the cached object holds the tensors: their ids stay theirs)
        trees = self._ddtree_trees_by_tensors.get(key)
        if trees is None:  # (eager placements make new tensors every step: the memo starts afresh when full)
            names = (*device_accept.NODE_ARRAYS, "node_depths", "node_offsets", "query_starts", "token_index")
            trees = device_accept.DeviceTrees(**dict(zip(names + ("ancestor_bits", "step_serial"), tensors)))
            keep(self._ddtree_trees_by_tensors, key, trees, MAX_KEPT_SHAPES)
        return trees

    def _ddtree_place(self, gpu: Dict[str, torch.Tensor], total: int, late: bool, whole: int):
        """:meth:`_ddtree_place_plan`, replayed as one CUDA graph per step shape for steps of whole trees (their
        shapes repeat; DDTREE_STEP_GRAPHS=0 turns these graphs off with the walk's)."""
        if not whole or not self._ddtree_step_graphs_on or self._ddtree_plan_graphs is None:
            return self._ddtree_place_plan(gpu, total, late, fixed_offsets=True)
        work = functools.partial(self._ddtree_place_plan, gpu, total, late)
        return self._ddtree_plan_graphs.run((self._ddtree_plan_staging.layout_key(), total, late), work)

    def _ddtree_place_plan(
        self, gpu: Dict[str, torch.Tensor], total: int, late: bool, fixed_offsets: bool = False
    ) -> Dict[str, torch.Tensor]:
        """The plan's device side, from its upload: the tree tokens where vLLM put placeholder drafts (late trees),
        the layout into the fixed buffers, the flat positions kept for the drafter and the depth-based positions
        written for the target (in place: the model reads these persistent buffers). ``fixed_offsets``: a placement
        run op by op writes the walk's int64 offsets into one buffer (``TreeStepBuffers.wide_offsets``), where a new
        tensor every step would move every walk graph's key (DDTREE_MIXED_WALK_GRAPHS); a placement graph keeps
        them in its own memory, at its own fixed address."""
        if late:
            self.input_ids.gpu[gpu["draft_step_index"]] = gpu["draft_tokens"]
        self._ddtree_buffers.load(
            gpu["row_start"], gpu["ancestor_bits"], gpu.get("node_offsets"), gpu.get("conv_index")
        )
        placed = {"flat_positions": self.positions[:total].clone()}
        if self.use_async_scheduling:
            # The host's starts are optimistic; vLLM computed the flat positions on the GPU from the corrected ones.
            self.positions[gpu["token_index"]] = self.positions[gpu["root_index"]] + gpu["depths"]
        else:
            self.positions[gpu["token_index"]] = gpu["positions"]
        if self.uses_mrope:
            mrope = self.mrope_positions.gpu
            mrope[:, gpu["token_index"]] = mrope[:, gpu["root_index"]] + gpu["depths"].to(mrope.dtype)
        if "node_parents" in gpu:
            offsets = gpu["node_offsets"]
            placed["node_offsets"] = self._ddtree_buffers.wide_offsets(offsets) if fixed_offsets else offsets.long()
        return placed

    @staticmethod
    def _ddtree_is_whole_tree_step(num_nodes: np.ndarray, num_reqs: int, total: int) -> int:
        """The tokens of each tree when every request verifies a tree of one size and nothing else is scheduled (a
        FULL graph of that many trees of that size may replay the step); 0 otherwise."""
        if num_reqs == 0 or num_nodes.shape[0] != num_reqs or int(num_nodes.sum()) != total:
            return 0
        size = int(num_nodes[0])
        return size if bool((num_nodes == size).all()) else 0

    def _ddtree_publish_counts(self, scheduler_output, num_scheduled_tokens, num_reqs: int) -> bool:
        """Asynchronous scheduling: publishes the step from vLLM's counts alone (which tokens are tree tokens, the
        fixed buffers' views), before vLLM builds the metadata; :meth:`_ddtree_prepare` fills the views once the
        trees are built. False: no request verifies a tree."""
        total = scheduler_output.total_num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        whole_counts = whole_tree_counts(num_reqs, total, num_scheduled_tokens, spec)  # the usual step, ~2 us
        if whole_counts is not None:
            rows, _, token_index, whole = whole_counts
        else:
            counts = tree_token_layout(self.input_batch.req_ids[:num_reqs], num_scheduled_tokens, spec)
            if counts is None:
                return False
            rows, num_nodes, token_index = counts
            whole = self._ddtree_is_whole_tree_step(num_nodes, num_reqs, total)
        hybrid = self._ddtree_conv_window > 0
        step_index = self._ddtree_buffers.step_index
        if token_index.shape[0] == total and total <= step_index.shape[0]:
            # Every scheduled token is a tree token (a step of decodes only): the tree tokens are the step's tokens
            # in order, and the GDN layers read the leading rows without an index. No upload (one copy launch and
            # its host work a step).
            gpu = {"token_index": self._ddtree_buffers.leading_step_index(total)}
        else:
            specs = {"token_index": (np.int64, token_index.shape)}
            if hybrid and token_index.shape[0] < total:
                specs["other_index"] = (np.int64, (total - token_index.shape[0],))
            host = self._ddtree_count_staging.host_arrays(specs)
            host["token_index"][:] = token_index
            if "other_index" in host:
                host["other_index"][:] = other_tokens(total, token_index)
            gpu = self._ddtree_count_staging.upload_host()
        num_trees = int(rows.shape[0])
        layout = self._ddtree_buffers.views(num_reqs, int(token_index.shape[0]), num_trees, conv=hybrid)
        self._ddtree_publish(layout, num_reqs, total, gpu["token_index"], gpu.get("other_index"), num_trees)
        self._ddtree_whole_tree_tokens = whole
        self._ddtree_early_token_index = token_index
        return True

    def _ddtree_plan_arrays(self, specs, total: int, hybrid: bool, extras: Dict) -> Dict[str, np.ndarray]:
        """Views of the plan staging's pinned buffer for the plan (returned: the Rust core writes them) and, into
        ``extras``, for what the runner adds: M-RoPE's root rows and depths, and the non-tree tokens of a hybrid
        target's mixed step."""
        full_specs, runner_names = self._ddtree_staged_plan_specs(specs, total, hybrid)
        views = self._ddtree_plan_staging.host_arrays(full_specs)
        for name in runner_names:
            extras[name] = views.pop(name)
        return views

    def _ddtree_staged_plan_specs(
        self, specs, total: int, hybrid: bool, subset: bool = False
    ) -> Tuple[Mapping[str, tuple], List[str]]:
        """:meth:`_ddtree_plan_specs` as a read-only mapping (which the staging recognises by identity) and the
        names of the runner's own arrays in it, made once per step shape: ``specs`` from :func:`plan_specs` is one
        object per shape (made anew, e.g. by a test's allocator, it is only not found here). ``subset``: with a
        device-planned subset step's row index (``proposal_rows``)."""
        key = (id(specs), total, hybrid, self.uses_mrope, self.use_async_scheduling, self._ddtree_device_accept, subset)
        known = _STAGED_PLAN_SPECS.get(key)
        if known is not None and known[0] is specs:
            return known[1], known[2]
        full_specs, extra_names = self._ddtree_plan_specs(specs, total, hybrid)
        if subset:
            full_specs["proposal_rows"] = (np.int64, (specs["batch_index"][1][0],))
            extra_names.append("proposal_rows")
        runner_names = [name for name in extra_names if name not in NODE_OUTPUTS]
        # ``specs`` is kept with its entry: its id cannot be reused by another object while the entry lives.
        entry = keep(
            _STAGED_PLAN_SPECS, key, (specs, types.MappingProxyType(full_specs), runner_names), MAX_KEPT_SHAPES
        )
        return entry[1], runner_names

    def _ddtree_plan_specs(self, specs, total: int, hybrid: bool) -> Tuple[Dict[str, tuple], List[str]]:
        """The plan staging's layout for the plan's ``specs``: those and the runner's own (named second)."""
        num_tree_tokens = specs["token_index"][1][0]
        per_node = (np.int64, (num_tree_tokens,))
        extra_specs = {}
        if self.uses_mrope or self.use_async_scheduling:
            # A tree token's position is its root's plus its depth: for M-RoPE (for text the three sections of a
            # decode position are equal; taking the root's keeps a multimodal offset), and under asynchronous
            # scheduling, where only the GPU knows each request's start.
            extra_specs["root_index"] = extra_specs["depths"] = per_node
        if hybrid and num_tree_tokens < total and not self.use_async_scheduling:
            # (Under asynchronous scheduling the step was published with its own, from the counts.)
            extra_specs["other_index"] = (np.int64, (total - num_tree_tokens,))
        if self._ddtree_device_accept:
            # The device walk's inputs (its node depths are ``depths``, uploaded once).
            extra_specs.update((name, per_node) for name in ("depths", *device_accept.NODE_ARRAYS))
            extra_specs["tree_query_starts"] = (np.int64, (specs["batch_index"][1][0],))
            extra_specs["step_serial"] = (np.int64, (1,))
        return {**specs, **extra_specs}, list(extra_specs)

    def _ddtree_check_spec_rows(self, plan: VerifyPlan, num_reqs: int) -> None:
        # vLLM's GDN metadata treats requests with num_scheduled == drafts + 1 as
        # spec decodes, in batch order; they must be exactly the tree requests.
        drafts = self.num_decode_draft_tokens.np[:num_reqs]
        # (A list's min: numpy's reduction costs ~5 us on a CPU for these few values.)
        if plan.every_request(num_reqs) and num_reqs and min(drafts.tolist()) >= 0:
            return  # every request verifies a tree, and vLLM counts every one a spec decode (the usual step)
        spec_rows = np.flatnonzero(drafts >= 0)
        if not same_values(spec_rows, plan.batch_index):
            raise RuntimeError(
                f"DDTree: vLLM's spec-decode rows {spec_rows.tolist()} differ from the tree rows "
                f"{plan.batch_index.tolist()}"
            )

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM's check that the drafter's queries fit below max_model_len, with the drafter's depth L.

        vLLM counts ``num_speculative_tokens`` queries, which for ddtree is the budget B: every request within
        ``B + 1`` tokens of max_model_len stopped the whole batch's drafting, so such requests verified no tree
        (budget 64 and 256 decoded one token per step there). The drafter queries ``L + 1`` positions after the
        longest sequence the step can leave (:meth:`_ddtree_longest_after_step`); vLLM's scheduler already cuts
        the scheduled trees to what fits, and a cut tree is the best tree of the smaller budget (``plan_verify``
        rebuilds it).
        """
        if common_attn_metadata is None or self.ddtree_cfg.draft_len is None:
            return super()._input_fits_in_drafter(common_attn_metadata)
        longest = self._ddtree_longest_after_step()
        if longest is None:
            longest = common_attn_metadata.max_seq_len
        return longest + self.ddtree_cfg.draft_len + 1 <= self.effective_drafter_max_model_len

    def _ddtree_longest_after_step(self) -> Optional[int]:
        """The longest sequence a request can have once this step is verified, from the engine's counts: a request
        verifying a tree grows by its root and at most its tree's depth (not by every node scheduled: up to B - L
        tokens less for a whole tree), any other by what was scheduled. The counts are exact at sampling, also under
        asynchronous scheduling (vLLM corrects its optimistic ones before; the attention metadata's lengths stay
        optimistic by up to a tree). None: synchronous and no tree verified (the metadata's lengths are exact)."""
        plan = self._ddtree_plan
        if plan is None and not self.use_async_scheduling:
            return None
        num_reqs = self.input_batch.num_reqs
        if not num_reqs:
            return None
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        lengths = computed + self.num_scheduled_tokens.np[:num_reqs]
        if plan is not None:
            lengths[plan.batch_index] = computed[plan.batch_index] + 1 + plan.deepest
        return int(lengths.max())

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def _ddtree_full_graphs(self) -> bool:
        """Whether uniform batches replay FULL graphs (vLLM's resolved mode, e.g. FULL_AND_PIECEWISE)."""
        mode = self.compilation_config.cudagraph_mode
        return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        """vLLM's dispatch, told which steps a FULL tree graph may replay.

        vLLM calls a batch uniform by its lengths alone (every request ``budget + 1`` tokens); for ddtree only
        a step in which every request verifies a tree of one size, with a FULL graph of exactly its trees (no
        padded requests), is one: trees of the engine's budget at a captured size, or of a schedule's smaller
        budget with a graph of their own (dispatched under their query length). Everything else (prefill chunks
        of ``budget + 1`` tokens, trees of other sizes) goes to PIECEWISE.
        """
        real_step = not self._ddtree_in_dummy_run and self._ddtree_full_graphs()
        query_len = None
        if real_step:
            num_tokens = kwargs.get("num_tokens", args[0] if args else None)
            query_len = self._ddtree_full_graph_query_len(num_tokens)
            kwargs["force_uniform_decode"] = query_len is not None
        with self._ddtree_uniform_query_len(query_len):
            result = super()._determine_batch_execution_and_padding(*args, **kwargs)
        if real_step:
            mode, descriptor = result[0], result[1]
            whole = kwargs["force_uniform_decode"] and mode == CUDAGraphMode.FULL
            self._ddtree_full_graph = (descriptor.num_tokens, descriptor.num_reqs) if whole else None
        return result

    def _ddtree_full_graph_query_len(self, num_tokens: int) -> Optional[int]:
        """The query length of the FULL graph this step may replay (None: none may)."""
        size = self._ddtree_whole_tree_tokens
        if size <= 0 or num_tokens % size:
            return None
        if size == self.uniform_decode_query_len:
            return size if num_tokens in (self.compilation_config.cudagraph_capture_sizes or ()) else None
        return size if (size, num_tokens // size) in self._ddtree_schedule_graphs else None

    @contextlib.contextmanager
    def _ddtree_uniform_query_len(self, query_len: Optional[int]):
        """vLLM's uniform-decode query length (``budget + 1``, read by its dispatch and its dummy runs) set to
        ``query_len`` for a schedule's smaller trees (None or the engine's own: unchanged)."""
        if query_len is None or query_len == self.uniform_decode_query_len:
            yield
            return
        dispatcher = self.cudagraph_dispatcher
        saved = self.uniform_decode_query_len, dispatcher.uniform_decode_query_len
        self.uniform_decode_query_len = dispatcher.uniform_decode_query_len = query_len
        try:
            yield
        finally:
            self.uniform_decode_query_len, dispatcher.uniform_decode_query_len = saved

    def _check_and_update_cudagraph_mode(self, *args, **kwargs):
        super()._check_and_update_cudagraph_mode(*args, **kwargs)
        self._ddtree_add_schedule_graphs()

    def _ddtree_add_schedule_graphs(self) -> None:
        """Adds the FULL graphs of a budget schedule's smaller trees (``config.schedule_tree_graphs``) to what vLLM
        captures and dispatches: their sizes to the capture sizes (vLLM rounded every size to a multiple of
        ``budget + 1``), a PIECEWISE key for each new size and a FULL key per graph. vLLM 0.25's V1 runner knows one
        uniform query length; the capture (:meth:`_warmup_and_capture`) and the dispatch set each graph's own."""
        from vllm.forward_context import BatchDescriptor

        self._ddtree_schedule_graphs = set()
        compilation = self.compilation_config
        if not (self.ddtree_cfg.varies_by_batch_size and self._ddtree_full_graphs() and hasattr(self, "drafter")):
            return
        if self.lora_config is not None:
            logger.info("DDTree: LoRA: a budget schedule's smaller trees replay PIECEWISE graphs")
            return
        top_k, depth = self.drafter.top_k, self.ddtree_cfg.draft_len
        graphs = schedule_tree_graphs(
            self.ddtree_cfg,
            lambda budget: tree_size(budget, top_k, depth) + 1,
            self.max_num_reqs,
            min(compilation.max_cudagraph_capture_size or 0, self.max_num_tokens),
        )
        sizes = set(compilation.cudagraph_capture_sizes or ())
        added = sorted({tokens * trees for tokens, trees in graphs} - sizes)
        compilation.cudagraph_capture_sizes = sorted(sizes | set(added))
        self.cudagraph_batch_sizes = list(compilation.cudagraph_capture_sizes)
        dispatcher = self.cudagraph_dispatcher
        dispatcher._compute_bs_to_padded_graph_size()
        if compilation.cudagraph_mode.mixed_mode() == CUDAGraphMode.PIECEWISE:
            for size in added:
                dispatcher.add_cudagraph_key(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=size))
        for tokens, trees in graphs:
            descriptor = BatchDescriptor(num_tokens=tokens * trees, num_reqs=trees, uniform=True)
            dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, descriptor)
        self._ddtree_schedule_graphs = set(graphs)
        logger.info(
            "DDTree: %d FULL graphs of the budget schedule's smaller trees (%s tokens per tree)",
            len(graphs),
            ", ".join(str(t) for t in sorted({tokens for tokens, _ in graphs})),
        )

    def _warmup_and_capture(self, desc, *args, **kwargs):
        """vLLM's capture of one graph, under the query length of a schedule's smaller trees for their graphs."""
        trees = desc.num_reqs or 0
        query_len = desc.num_tokens // trees if desc.uniform and trees else None
        if (query_len, trees) not in self._ddtree_schedule_graphs:
            query_len = None
        with self._ddtree_uniform_query_len(query_len):
            return super()._warmup_and_capture(desc, *args, **kwargs)

    def _dummy_run(
        self, num_tokens, cudagraph_runtime_mode=None, force_attention=False, uniform_decode=False, *args, **kwargs
    ):
        """vLLM's warm-up, profile and capture runs; uniform ones (FULL graphs) run on dummy trees.

        The warm-up before a FULL capture then compiles the tree kernels for the graph's shapes, and the capture
        records them; a capture keeps the GDN layers' commit inputs (:class:`CapturedCommits`).
        """
        tree_size = self.uniform_decode_query_len  # budget + 1, or a schedule's smaller trees during their capture
        trees = (
            uniform_decode
            and self._ddtree_full_graphs()
            and hasattr(self, "drafter")
            and num_tokens % tree_size == 0
            and (force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL)
        )
        self._ddtree_in_dummy_run = True
        step = saved_drafts = None
        try:
            if trees:
                step, saved_drafts = self._ddtree_stage_dummy_step(num_tokens // tree_size, tree_size)
            out = super()._dummy_run(
                num_tokens, cudagraph_runtime_mode, force_attention, uniform_decode, *args, **kwargs
            )
            full_capture = trees and kwargs.get("is_graph_capturing") and cudagraph_runtime_mode == CUDAGraphMode.FULL
            if step is not None and full_capture:
                from vllm.utils.torch_utils import weak_ref_tensor

                self._ddtree_captured.record((num_tokens, num_tokens // tree_size), step, weak_ref_tensor)
            if full_capture and self._ddtree_precapture and not self._ddtree_profiling_graph_memory:
                self._ddtree_precapture_step_graphs(num_tokens // tree_size, tree_size)
            return out
        finally:
            self._ddtree_in_dummy_run = False
            context.withdraw()
            self._ddtree_gdn_step = None
            if saved_drafts is not None:
                self.num_decode_draft_tokens.cpu[: saved_drafts.shape[0]] = saved_drafts

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        """vLLM's, then ddtree's references into the KV cache dropped: the target layers' caches, the K/V-move and
        commit graphs (captured on them) and the commit inputs FULL captures recorded. vLLM allocates a KV cache
        more than once in a process (with ``gpu_memory_utilization``, its CUDA-graph memory profile makes a
        minimal one and frees it before the real one), and a K/V move into the freed cache would go nowhere
        silently. All of them are made again from the new cache when next needed."""
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self._ddtree_forget_kv_cache()

    def _ddtree_forget_kv_cache(self) -> None:
        """ddtree's state made on a KV cache, empty: at start-up, and whenever vLLM allocates another cache."""
        self._ddtree_kv_layers: Optional[List[tuple]] = None
        self._ddtree_captured = CapturedCommits()
        self._ddtree_commit_graphs: Optional[CommitGraphs] = None
        on_gpu = self.device.type == "cuda"
        self._ddtree_kv_move_graphs = ShapeGraphs(self._ddtree_capture("kv moves")) if on_gpu else None

    def profile_cudagraph_memory(self) -> int:
        """vLLM's estimate of its CUDA graphs' memory (run before the KV cache exists, unless ``kv_cache_memory_bytes``
        is given): it captures the largest sizes on a minimal profiling KV cache, under inference mode, then frees
        that cache and clears its graphs. ddtree's start-up captures (DDTREE_PRECAPTURE) are left out of it: its own
        graphs would outlive the profile, one of ``all``'s commit graphs writing into the freed profiling cache,
        and tensors made under inference mode here cannot be written by the real capture that follows (outside
        it). They are captured after the KV cache, with vLLM's own captures, as their lazy captures always were;
        the step graphs' few MB each are not in vLLM's estimate either way."""
        self._ddtree_profiling_graph_memory = True
        try:
            return super().profile_cudagraph_memory()
        finally:
            self._ddtree_profiling_graph_memory = False

    def _ddtree_publish(self, layout, num_reqs, num_tokens, token_index, other_index, num_trees):
        """Publishes a tree layout (views of :class:`TreeStepBuffers`) to the attention backend and, for GDN
        targets, to the GDN layers; returns the GDN step (None: no GDN layers). ``num_tokens`` counts the step's
        scheduled tokens, ``token_index`` places the tree tokens among them."""
        attention = TreeAttentionInputs(
            row_start=layout["row_start"],
            ancestor_bits=layout["ancestor_bits"],
            num_reqs=num_reqs,
            num_tokens=num_tokens,
        )
        step = None
        if self._ddtree_conv_window > 0:
            step = GdnTreeStep(
                token_index=token_index,
                other_index=other_index,
                node_offsets=layout["node_offsets"],
                ancestor_bits=layout["ancestor_bits"],
                conv_index=layout["conv_index"],
                num_requests=num_trees,
                num_tree_tokens=int(token_index.shape[0]),
            )
        context.publish(PublishedStep(attention=attention, gdn=step))
        # The runner keeps the GDN step past the forward: the commit after acceptance reads what its layers
        # recorded.
        self._ddtree_gdn_step = step
        return step

    def _ddtree_precapture_step_graphs(self, num_trees: int, tree_tokens: int) -> None:
        """DDTREE_PRECAPTURE: the placement and walk graphs of a step of ``num_trees`` whole trees of ``tree_tokens``
        tokens, captured now (after vLLM's FULL capture of that size) on filler trees through the plan's own path,
        so that serving's first step of the size replays them. Filler trees of a size have its real steps' shapes,
        hence their keys: the same staged layout (the placement's key) and, from the placement graph's own outputs,
        the same trees object (the walk's). The commit's graphs follow with ``DDTREE_PRECAPTURE=all``
        (:meth:`_ddtree_precapture_commit`); otherwise they are captured at the size's first step. Late trees only:
        with trees built at proposal a step's drafts are known, and its layout is another."""
        if not (self._ddtree_late_trees and self._ddtree_step_graphs_on and self._ddtree_plan_graphs is not None):
            return
        self.ddtree_stats.precaptured_sizes += 1
        total = num_trees * tree_tokens
        hybrid = self._ddtree_conv_window > 0
        extras: Dict[str, np.ndarray] = {}
        plan = self._ddtree_filler_plan(
            num_trees, tree_tokens, lambda specs: self._ddtree_plan_arrays(specs, total, hybrid, extras)
        )
        fill_plan_extras(extras, plan, total)
        gpu = self._ddtree_plan_staging.upload_host()
        self._ddtree_place(gpu, total, True, tree_tokens)  # run, then captured
        placed = self._ddtree_place(gpu, total, True, tree_tokens)  # the graph's outputs, as serving gets them
        self._ddtree_precapture_walk(gpu, placed, plan, num_trees, tree_tokens)
        planner = self._ddtree_device_planner
        if planner is not None and planner.serves(num_trees, tree_tokens):
            # DDTREE_DEVICE_PLAN: the device plan's graph of the size (its first run compiles the Triton kernels),
            # and the walk's graphs of its outputs; the kernels build trees from whatever the top-K buffer holds.
            try:
                gpu, placed = self._ddtree_capture_device_plan(num_trees, tree_tokens, total)
            except Exception as error:  # (a GPU whose Triton cannot compile or fit the kernels, say)
                self._ddtree_device_plan_failed(error, (num_trees, tree_tokens))
                return
            self._ddtree_precapture_walk(gpu, placed, plan, num_trees, tree_tokens)
            self.ddtree_stats.precaptured_device_plans += 1
            if self._ddtree_device_subsets:
                self._ddtree_precapture_subset_plan(plan, num_trees, tree_tokens, total)

    def _ddtree_precapture_subset_plan(self, plan: VerifyPlan, num_trees: int, tree_tokens: int, total: int) -> None:
        """DDTREE_DEVICE_PLAN_SUBSETS: the subset layout's graph of a size (and its walk's), on rows 0 .. num_trees -
        1, so that the size's first subset step replays it instead of capturing while serving. Should it fail, subset
        steps are planned on the host from then on (with a warning); the whole steps' device plan stays."""
        try:
            gpu, placed = self._ddtree_capture_device_plan(num_trees, tree_tokens, total, np.arange(num_trees))
            self._ddtree_precapture_walk(gpu, placed, plan, num_trees, tree_tokens)
        except Exception as error:  # (a GPU whose gather cannot be captured, say)
            self._ddtree_device_subsets = False
            logger.warning(
                "DDTree: the device plan's subset steps failed at start-up on %d trees of %d tokens (%s: %s): "
                "such steps are planned on the host",
                num_trees,
                tree_tokens,
                type(error).__name__,
                error,
            )
            return
        self.ddtree_stats.precaptured_subset_plans += 1

    def _ddtree_capture_device_plan(self, num_trees: int, tree_tokens: int, total: int, rows=None):
        """A device-planned step's graph of a size (``rows``: a subset step's layout) run once, then captured; returns
        its upload's views and placement outputs, as serving's steps get them. The kernels build trees from whatever
        the top-K buffer holds."""
        self._ddtree_device_upload_and_place(num_trees, tree_tokens, total, -1, rows)  # run, then captured
        return self._ddtree_device_upload_and_place(num_trees, tree_tokens, total, -1, rows)

    def _ddtree_device_plan_failed(self, error: Exception, shape: Tuple[int, int]) -> None:
        """The device plan's kernels failed at start-up (their first run, which compiles them): under the default
        (``auto``) every step is planned on the host from here on, said in the log and the summary; with
        ``DDTREE_DEVICE_PLAN=1`` start-up fails, naming the error."""
        failure = (
            f"kernels failed at start-up on {shape[0]} trees of {shape[1]} tokens: {type(error).__name__}: {error}"
        )
        if device_plan_mode() == "1":
            raise RuntimeError(f"DDTree: DDTREE_DEVICE_PLAN=1, but its {failure}") from error
        self._ddtree_device_plan_off("its " + failure, "the device plan's " + failure, warning=True)

    def _ddtree_device_plan_off(self, reason: str, detail: str, warning: bool = False) -> None:
        """The host plans every step: no device planner; ``reason`` for the summary (``off: ...``), ``detail`` for
        the log."""
        self._ddtree_device_planner = None
        self._ddtree_device_plan_state = "off: " + reason
        (logger.warning if warning else logger.info)("DDTree: every step's trees built on the host (%s)", detail)

    def _ddtree_filler_plan(self, num_trees: int, tree_tokens: int, arrays) -> VerifyPlan:
        """The host plan of ``num_trees`` filler trees of ``tree_tokens`` tokens (no proposals: each request
        verifies a filler tree of its placeholders), laid out into what ``arrays`` allocates: a whole-tree step of
        that shape, for captures and shape constants. Its serial is -1 (no real step's: its walk's rows are never
        read)."""
        req_ids = [f"ddtree-filler-{i}" for i in range(num_trees)]
        plan = plan_verify(
            TreeStore(tree_tokens - 1),
            req_ids,
            np.zeros(num_trees, dtype=np.int64),
            np.full(num_trees, tree_tokens, dtype=np.int64),
            {req_id: [PLACEHOLDER] * (tree_tokens - 1) for req_id in req_ids},
            conv_window=self._ddtree_conv_window,
            words=self._ddtree_buffers.words,
            arrays=arrays,
            unproposed=(self.drafter.draft_len, self.drafter.top_k),
        )
        plan.step_serial = -1
        return plan

    def _ddtree_precapture_walk(self, gpu, placed, plan: VerifyPlan, num_trees: int, tree_tokens: int) -> None:
        """The walk's graph of a precaptured placement's trees (then, with ``DDTREE_PRECAPTURE=all``, the
        commit's)."""
        if not (self._ddtree_device_accept and self._ddtree_walk_graphs is not None and "node_parents" in gpu):
            return
        total = num_trees * tree_tokens
        trees = self._ddtree_device_trees(gpu, placed["node_offsets"])
        target = torch.zeros(total, dtype=torch.int64, device=self.device)  # (the sampler's tokens)
        walk_args = (tree_tokens, plan.draft_depth + 1, plan.num_tokens, plan.conv_window)
        self._ddtree_walk_graphs.walk(trees, target, *walk_args)  # run, then captured
        if self._ddtree_precapture_commits:
            walked = self._ddtree_walk_graphs.walk(trees, target, *walk_args)  # the graph's outputs
            self._ddtree_precapture_commit(walked, num_trees, total)

    def _ddtree_precapture_commit(self, walked: Dict[str, torch.Tensor], num_trees: int, total: int) -> None:
        """DDTREE_PRECAPTURE=all: the commit of a step of ``num_trees`` whole trees (``total`` tokens) as ``_sample``
        runs it after a replayed walk, on the precapture's walked filler trees: the GDN commit graph (with the K/V
        moves, in place) of a hybrid target, the K/V-move graph of an attention-only one. Their keys are the FULL
        graph and the addresses of the walk graph's outputs and of the fixed tree buffers, which serving's steps of
        that size hand over too. The first run is eager and writes: it commits the filler step into slot 0, vLLM's
        null block, where no request's state lives."""
        saved = (self._ddtree_full_graph, self._ddtree_walk_replayed, self._ddtree_accept)
        self._ddtree_full_graph, self._ddtree_walk_replayed, self._ddtree_accept = (total, num_trees), True, None
        try:
            if self._ddtree_conv_window > 0:
                # The FULL graph has not replayed since its capture (vLLM's capture call replays nothing), so the
                # commit inputs it recorded hold whatever its memory held, the state slots too (for two trees or
                # more a copy made inside the graph): unbounded slots to write at. Serving's first replay rewrites
                # them.
                for pending in self._ddtree_captured.replayed((total, num_trees)).values():
                    pending.slots.zero_()
                layout = self._ddtree_buffers.views(num_trees, total, num_trees, conv=True)  # (serving's views too)
                self._ddtree_gdn_step = GdnTreeStep(
                    token_index=self._ddtree_buffers.leading_step_index(total),
                    other_index=None,
                    node_offsets=layout["node_offsets"],
                    ancestor_bits=layout["ancestor_bits"],
                    conv_index=layout["conv_index"],
                    num_requests=num_trees,
                    num_tree_tokens=total,
                )
            if not self._ddtree_commit_gdn(walked):
                self._ddtree_move_kv(walked["kv_src"], walked["kv_dst"])
            self.ddtree_stats.precaptured_commits += 1
        finally:
            self._ddtree_full_graph, self._ddtree_walk_replayed, self._ddtree_accept = saved
            self._ddtree_gdn_step = None

    def _ddtree_stage_dummy_step(self, num_trees: int, tree_tokens: int):
        """Dummy whole trees of ``tree_tokens`` tokens for a uniform dummy run of ``num_trees`` requests, published
        to the layers."""
        layout = self._ddtree_buffers.stage_dummy_trees(num_trees, self.ddtree_cfg.draft_len, tree_tokens)
        num_tokens = num_trees * tree_tokens
        token_index = torch.arange(num_tokens, device=self.device)
        step = self._ddtree_publish(layout, num_trees, num_tokens, token_index, None, num_trees)
        saved = None
        if step is not None:
            # vLLM's GDN builder takes requests with drafts as spec decodes (a capture derives them itself).
            saved = self.num_decode_draft_tokens.cpu[:num_trees].clone()
            self.num_decode_draft_tokens.cpu[:num_trees] = tree_tokens - 1
        return step, saved

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.ddtree_stats.close_step(ShapeGraphs.first_runs)
        if self._ddtree_step_timer is not None:
            self._ddtree_step_timer.start()
            self._ddtree_first_runs_at_start = ShapeGraphs.first_runs
        try:
            output = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            context.withdraw()
        self._ddtree_publish_for_grammars(scheduler_output)
        return output

    def _ddtree_publish_for_grammars(self, scheduler_output) -> None:
        """Structured outputs (patch 12): a step with a structured request hands its trees to the scheduler, which
        computes the step's grammar masks after this call returns (on this thread, with one GPU)."""
        plan = self._ddtree_plan
        if plan is None or not getattr(scheduler_output, "has_structured_output_requests", False):
            grammar.publish_step(None)
            return
        req_ids = [self.input_batch.req_ids[i] for i in plan.batch_index]
        grammar.publish_step(grammar.StepTrees(scheduler_output, req_ids, plan.host_trees))

    # ---- acceptance ----------------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None and self._ddtree_samples_draftless_step(logits):
            out = self._ddtree_sample_draftless_step(logits)
        else:
            out = super()._sample(logits, spec_decode_metadata)
        plan, accept, gpu = self._ddtree_plan, self._ddtree_accept, self._ddtree_accept_gpu
        self._ddtree_accept_gpu = None
        if plan is not None and gpu is not None:
            # Host time of the commit's launches (KV moves per attention layer, two per GDN layer): under FULL
            # graphs they are the step's largest host work outside the replay.
            stats = self.ddtree_stats
            with stats.timed("commit"):
                boundaries = self._ddtree_state_boundaries(plan)
                with stats.detail("commit: gdn"):
                    moved = self._ddtree_commit_gdn(gpu, boundaries)
                if not moved:  # (the K/V moves not recorded with the GDN commit)
                    with stats.detail("commit: kv moves"):
                        self._ddtree_move_kv(gpu["kv_src"], gpu["kv_dst"])
            self.drafter.context_order = gpu["context_order"]
            self.drafter.flat_positions = self._ddtree_flat_positions
            if accept is not None:
                self.ddtree_stats.observe(plan, accept)
            else:  # walked on the device: counted once the copy of its paths has landed
                with self.ddtree_stats.timed("stats"):  # (host work of every step, a copy every PATH_RING_SLOTS)
                    self._ddtree_count_device_steps(*self._ddtree_send_paths(gpu, plan))
            self.ddtree_stats.count_verify_step(plan, self._ddtree_full_graph)
        else:
            self.drafter.context_order = None
            self.drafter.flat_positions = None
        return out

    def ddtree_min_tokens_pending(self, num_reqs: int, num_rows: np.ndarray) -> List[Pending]:
        """What the step's requests with ``min_tokens`` still need before a stop token, from the engine's counts
        (exact at sampling, also under asynchronous scheduling); ``num_rows[r]`` is request ``r``'s logits rows.
        Called by the rejection sampler."""
        if not len(self._ddtree_min_tokens):
            return []
        batch = self.input_batch
        return self._ddtree_min_tokens.pending(
            batch.req_id_to_index,
            num_reqs,
            batch.num_computed_tokens_cpu,
            self.num_scheduled_tokens.np,
            batch.num_prompt_tokens,
            num_rows,
        )

    def ddtree_accept(self, plan: VerifyPlan, node_tokens: np.ndarray, width: int) -> Dict[str, torch.Tensor]:
        """Walks the trees and uploads what follows in one copy: the chain rows the sampler returns
        (``output_tokens``), the KV moves, the drafter's row order and, for GDN targets, the commit plan (one
        Rust call writes them into the acceptance staging's pinned buffer). Called by the rejection sampler."""
        with self.ddtree_stats.timed("accept"):
            self._ddtree_accept = accept(plan, node_tokens, width, arrays=self._ddtree_accept_staging.host_arrays)
            gpu = self._ddtree_accept_staging.upload_host()
        self._ddtree_accept_gpu = gpu
        return gpu

    def ddtree_device_accepts(self, plan: VerifyPlan) -> bool:
        """Whether this step's trees are walked on the device: switched on, and the plan carries the device walk's
        inputs (uploaded when the switch was on at planning)."""
        return self._ddtree_device_accept and plan.device_trees is not None

    @property
    def ddtree_late_trees(self) -> bool:
        """Whether the proposer defers the tree build to the next verification (read by the proposer)."""
        return self._ddtree_late_trees

    def ddtree_output_to_host(self, out: torch.Tensor) -> None:
        """Starts the copy of a device-walked step's chain rows to the host, before the drafter is queued: vLLM's
        bookkeeping (``_bookkeeping_sync``) then waits for the verification only, not for the drafter behind it.
        Called by the rejection sampler; a synchronous engine only (asynchronous scheduling reads them its way)."""
        if self.use_async_scheduling:
            return
        if self._ddtree_output_host is None or self._ddtree_output_host.numel() < out.numel():
            on_gpu = self.device.type == "cuda"
            capacity = max(out.numel(), self.max_num_reqs * out.shape[1])
            self._ddtree_output_host = torch.empty(capacity, dtype=out.dtype, pin_memory=on_gpu)
            self._ddtree_output_landed = torch.cuda.Event() if on_gpu else None
        host = self._ddtree_output_host[: out.numel()].view(out.shape)
        host.copy_(out, non_blocking=True)
        if self._ddtree_output_landed is not None:
            self._ddtree_output_landed.record(current_stream())
        self._ddtree_output_early = (out, host)

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        """vLLM's bookkeeping, reading the chain rows from their early copy when the sampler made one (vLLM's own
        read, ``parse_output``'s ``.cpu()``, would wait for everything queued, the drafter included)."""
        early, self._ddtree_output_early = self._ddtree_output_early, None
        if early is not None and early[0] is sampler_output.sampled_token_ids:
            if self._ddtree_output_landed is not None:
                with record_function_or_nullcontext("ddtree: wait for the chain rows"):
                    self._ddtree_output_landed.synchronize()
            sampler_output = dataclasses.replace(sampler_output, sampled_token_ids=early[1])
            self.ddtree_stats.early_output_steps += 1
        return super()._bookkeeping_sync(scheduler_output, sampler_output, *args, **kwargs)

    def _ddtree_samples_draftless_step(self, logits) -> bool:
        """Whether ddtree's sampler, not vLLM's, samples this step without drafts: when a request in it is seeded.
        vLLM's sampler draws a seeded request's noise from its generator; ddtree's takes it from the request's seed
        and the position sampled (``seeded_noise``). A seeded request's first token is sampled in a step without
        drafts or beside other requests' trees, as arrival times fall: with two rules, one request sent twice
        could start differently (the served n=2 seeded check did, ``gpu-h200-device-plan-c4ff208``)."""
        if logits is None or self._ddtree_draftless_logits_indices is None:
            return False
        if not self.input_batch.sampling_metadata.generators:  # (the usual step: nothing more to look at)
            return False
        from ddtree.vllm.sampler import DDTreeRejectionSampler

        return isinstance(getattr(self, "rejection_sampler", None), DDTreeRejectionSampler)

    def _ddtree_sample_draftless_step(self, logits):
        """vLLM's ``_sample`` of a step without drafts, by ddtree's sampler (one row per request, no tree)."""
        from ddtree.vllm.sampler import DraftlessStep

        self.input_batch.update_async_output_token_ids()  # (as vLLM's own does first: penalties read them)
        step = DraftlessStep.of(self._ddtree_draftless_logits_indices)
        return self.rejection_sampler(step, None, logits, self.input_batch.sampling_metadata)

    def ddtree_accept_on_device(
        self, plan: VerifyPlan, node_tokens: torch.Tensor, width: int
    ) -> Dict[str, torch.Tensor]:
        """:meth:`ddtree_accept` without the host: the walk and its layout as device tensors
        (:func:`ddtree.vllm.device_accept.accept_on_device`). Called by the rejection sampler."""
        with self.ddtree_stats.timed("accept"):
            graphs, num_tokens = self._ddtree_walk_graphs_for_step(plan)
            walk_args = (width, plan.draft_depth + 1, num_tokens, plan.conv_window)
            self._ddtree_walk_replayed = False
            if graphs is not None:
                before, copied, in_place = graphs.replayed, graphs.copied_walks, graphs.targets_in_place
                gpu = graphs.walk(plan.device_trees, node_tokens, *walk_args)
                self._ddtree_walk_replayed = graphs.replayed > before
                self.ddtree_stats.walk_graph_steps += self._ddtree_walk_replayed
                self.ddtree_stats.walk_target_in_place_steps += graphs.targets_in_place > in_place
                self.ddtree_stats.mixed_walk_graph_steps += self._ddtree_walk_replayed and not self._ddtree_full_graph
                self.ddtree_stats.walk_copied_steps += graphs.copied_walks > copied
            else:
                gpu = device_accept.accept_on_device(
                    plan.device_trees, node_tokens, *walk_args, ring=self._ddtree_counts
                )
        self._ddtree_accept = None
        self._ddtree_accept_gpu = gpu
        return gpu

    def ddtree_walk_target(self, plan: VerifyPlan, width: int, rows: int) -> Optional[torch.Tensor]:
        """Where the sampler may write the step's node tokens (int64 ``[rows]``, every row a tree node): the
        buffer the step's walk graph reads them from (``WalkGraphs.target_for``), so the walk copies nothing. None:
        anywhere (no walk graph, or not known yet; the walk copies them in). Called by the rejection sampler."""
        with self.ddtree_stats.timed("accept"):  # (the walk's host work, looked up ahead of it)
            graphs, num_tokens = self._ddtree_walk_graphs_for_step(plan)
            if graphs is None:
                return None
            trees, depth = plan.device_trees, plan.draft_depth
            return graphs.target_for(trees, rows, width, depth + 1, num_tokens, plan.conv_window)

    @staticmethod
    def _ddtree_mixed_walk_graphs_wanted(cudagraph_mode) -> bool:
        """DDTREE_MIXED_WALK_GRAPHS, in an engine that runs FULL CUDA graphs: under enforce_eager (mode NONE) walk
        graphs of mixed steps would be the engine's only graphs, and a surprise; under PIECEWISE alone no step is a
        FULL graph's, so every tree step would walk through graphs laid over the token budget (never run on a GPU)."""
        if not mixed_walk_graphs_enabled() or cudagraph_mode is None:
            return False
        return cudagraph_mode.has_full_cudagraphs()

    def _ddtree_walk_graphs_for_step(self, plan: VerifyPlan) -> Tuple[Optional[WalkGraphs], int]:
        """The walk graphs for this step (None: the walk op by op) and the tokens its walk lays the drafter's row
        order over. On a GPU with DDTREE_STEP_GRAPHS on: a step a FULL graph replayed, over its own tokens; with
        DDTREE_MIXED_WALK_GRAPHS, a step with a prefill beside trees that are all of one size, over the
        scheduler's token budget (the drafter reads the first ``num_tokens`` rows of the order), so that its
        graph is one per tree count and size, not per prefill length. Op by op: trees cut (near
        ``max_model_len``: a new size nearly every step, rarely replayed), a step without a prefill beside its trees
        (not what the graphs are for), and a tree count and size beyond the first ``MAX_MIXED_WALK_SHAPES`` met (each
        shape's graphs hold memory of their own for the engine's life)."""
        graphs = self._ddtree_walk_graphs if self._ddtree_step_graphs_on else None
        if graphs is None or self._ddtree_full_graph is not None:
            return graphs, plan.num_tokens
        if self._ddtree_mixed_walk_graphs and self._ddtree_mixed_walk_shape_allowed(plan):
            return graphs, max(plan.num_tokens, self.max_num_tokens)
        return None, plan.num_tokens

    def _ddtree_mixed_walk_shape_allowed(self, plan: VerifyPlan) -> bool:
        """Whether a step that no FULL graph replayed walks through the walk graphs (DDTREE_MIXED_WALK_GRAPHS): a
        prefill beside trees that are all whole and of one size, of a shape met before or while fewer than
        ``MAX_MIXED_WALK_SHAPES`` are."""
        nodes = plan.num_nodes
        if not nodes.shape[0] or nodes.min() != nodes.max() or not prefill_beside_trees(plan):
            return False
        if cut_trees(nodes, plan.proposed_budgets):  # (near max_model_len: a new size nearly every step)
            return False
        shape = (int(nodes.shape[0]), int(nodes[0]))
        shapes = self._ddtree_mixed_walk_shapes
        if shapes is None:
            shapes = self._ddtree_mixed_walk_shapes = set()
        if shape not in shapes and len(shapes) >= MAX_MIXED_WALK_SHAPES:
            return False
        shapes.add(shape)
        return True

    def _ddtree_new_staging(self) -> StepStaging:
        """A staging for one upload a step, its events recorded on vLLM's current stream (``ddtree.vllm.streams``)."""
        return StepStaging(self.device, current_stream=current_stream)

    def _ddtree_path_ring(self) -> PathRing:
        """The ring the device walk writes its accepted paths into, for the statistics: ``PATH_RING_SLOTS`` slots
        (``AUTO_PATH_RING_SLOTS`` under an ``auto`` budget), copied to the host together once they are all written
        (the host runs a step ahead; a copy is read once it has landed)."""
        width = (self.ddtree_cfg.draft_len or 0) + 2
        slots = AUTO_PATH_RING_SLOTS if self.ddtree_cfg.auto else PATH_RING_SLOTS
        return PathRing(self.device, self.max_num_reqs, width=width, slots=slots, current_stream=current_stream)

    def _ddtree_send_paths(self, gpu: Dict[str, torch.Tensor], plan: VerifyPlan):
        """Notes a device-walked step whose walk wrote its accepted paths into the ring (one row per tree: its
        length, then the path); every ``PATH_RING_SLOTS``-th step starts the ring's copy. Returns older steps that
        had to be read first (``PathRing.note``)."""
        return self._ddtree_counts.note(plan.step_serial, int(plan.num_nodes.shape[0]), plan)

    def _ddtree_count_device_steps(self, *steps) -> None:
        """Counts device-walked steps in the statistics: ``(plan, rows)`` each, as the ring handed them
        (``PathRing.note``, ``PathRing.landed``)."""
        self.ddtree_stats.observe_device_steps(steps)

    def _ddtree_commit_gdn(self, gpu: Dict[str, torch.Tensor], boundaries=None) -> bool:
        """Commits the GDN layers' accepted states; True when the step's K/V moves went with them (one commit graph
        reading the walk's outputs in place, ``DDTREE_COMMIT_IN_PLACE``), False when the caller moves them.
        ``boundaries``: the step's boundary commits (``_ddtree_state_boundaries``), run first."""
        step = self._ddtree_gdn_step
        self._ddtree_gdn_step = None
        if self._ddtree_conv_window == 0:
            return False
        if step is None:
            raise RuntimeError("DDTree: a hybrid target verified trees without a GDN tree step")
        commit = GdnCommitPlan(
            node_offsets=step.node_offsets,
            paths=gpu["paths"],
            path_lengths=gpu["path_lengths"],
            conv_index=gpu["commit_conv_index"],
        )
        # A FULL graph replayed the layers: their commit inputs are where its capture recorded them.
        full = self._ddtree_full_graph is not None
        commits = self._ddtree_captured.replayed(self._ddtree_full_graph) if full else step.pending
        if boundaries is not None:
            # Before the main commit, which overwrites the states the boundary commits read.
            commit_boundaries(commits, commit, *boundaries, conv_window=self._ddtree_conv_window)
        if full:
            graphs = self._ddtree_commit_graphs_for(commit)
            if graphs is not None:
                before = graphs.replayed
                # A walk that replayed its graph left the paths in that graph's outputs (fixed addresses).
                in_place = self._ddtree_commit_in_place and self._ddtree_walk_replayed and self._ddtree_accept is None
                # In place, the K/V moves (the walk's outputs too, at fixed addresses) join the same graph.
                src, dst = gpu["kv_src"], gpu["kv_dst"]
                kv_moves = (src, dst, self._ddtree_move_kv_now) if in_place and src.shape[0] else None
                graphs.commit(self._ddtree_full_graph, commits, commit, commit_layer, in_place, kv_moves)
                self.ddtree_stats.commit_graph_steps += graphs.replayed - before
                self.ddtree_stats.commit_in_place_steps += in_place and graphs.replayed > before
                return in_place
            for pending in commits.values():
                commit_layer(pending, commit)
            return False
        if not step.pending:
            raise RuntimeError("DDTree: a hybrid target verified trees but no GDN layer recorded its commit")
        commit_pending(step, commit)
        return False

    def _ddtree_state_boundaries(self, plan: VerifyPlan) -> Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """Prefix caching with a hybrid target (``mamba_align``): the step's boundary commits as ``(prefix [R],
        {GDN layer: its group's destination blocks [R]})``, or None when no tree can reach the end of its root's
        state block. Read on the host: the trees' computed tokens (vLLM has applied the previous step's acceptance
        to them before its pre-step copy, under asynchronous scheduling too), their scheduled tokens and the state
        groups' block tables."""
        if not self._ddtree_aligned_states:
            return None
        # The state groups' own block size (vLLM's align mode indexes their columns by it; cache_config's
        # mamba_block_size can be another number once vLLM aligned the page sizes).
        groups = self._ddtree_state_groups()
        block_size = int(self.kv_cache_config.kv_cache_groups[groups[0][0]].kv_cache_spec.block_size)
        rows = np.asarray(plan.batch_index, dtype=np.int64)
        starts = self.query_start_loc.np
        computed = self.input_batch.num_computed_tokens_cpu[rows]
        prefix, column = boundary_prefixes(computed, starts[rows + 1] - starts[rows], block_size, plan.draft_depth + 1)
        reaching = prefix > 0
        if not reaching.any():
            return None
        self.ddtree_stats.boundary_commit_trees += int(reaching.sum())
        self.ddtree_stats.boundary_commit_steps += 1
        columns = np.where(reaching, column, 0)
        blocks = [
            np.where(reaching, self.input_batch.block_table[group_id].get_numpy_array()[rows, columns], -1)
            for group_id, _ in groups
        ]
        # One pinned copy, not waited for (a pageable copy would wait for the whole stream).
        uploaded = self._ddtree_boundary_staging.upload([prefix] + [b.astype(np.int32) for b in blocks])
        slots = {name: tensor for (_, layers), tensor in zip(groups, uploaded[1:]) for name in layers}
        return uploaded[0], slots

    def _ddtree_clear_fresh_states(self, new_requests, spec: Mapping[str, Sequence[int]]) -> None:
        """Zeroes the recurrent states (conv window and SSM state, every GDN layer) of new requests that verify a
        tree in their first step: a one-token prompt vLLM padded with placeholders. Its state slot still holds a
        finished request's states (vLLM zeroes new attention blocks only, and its prefills start from zero through
        ``has_initial_state``, which a tree step does not read), and the tree's verification and commit start from
        the slot. Queued before the step's forward, launch by launch (a rare step)."""
        fresh = [new.req_id for new in new_requests if new.num_computed_tokens == 0 and spec.get(new.req_id)]
        if not fresh:
            return
        rows = np.fromiter((self.input_batch.req_id_to_index[r] for r in fresh), dtype=np.int64, count=len(fresh))
        context = self.compilation_config.static_forward_context
        for group_id, layers in self._ddtree_state_groups():
            # The request's first state column (cache mode "none": its one block; "align": the block of position 0).
            slots = torch.from_numpy(self.input_batch.block_table[group_id].get_numpy_array()[rows, 0].astype(np.int64))
            slots = slots.to(self.device, non_blocking=True)
            for name in layers:
                for state in context[name].kv_cache:  # (conv, ssm), each [blocks, ...] (patch 5d reads them so)
                    state.index_fill_(0, slots, 0)
        self.ddtree_stats.fresh_state_trees += len(fresh)

    def _ddtree_state_groups(self) -> List[Tuple[int, List[str]]]:
        """(KV-cache group, its layers) of each recurrent-state group: each has its own block ids."""
        if self._ddtree_state_group_layers is None:
            groups = self.kv_cache_config.kv_cache_groups
            self._ddtree_state_group_layers = [
                (g, list(group.layer_names))
                for g, group in enumerate(groups)
                if getattr(group.kv_cache_spec, "mamba_cache_mode", None) is not None
            ]
        return self._ddtree_state_group_layers

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output) -> None:
        """Prefix caching with a hybrid target: vLLM's post-step copies read per-draft state columns a ddtree engine
        does not have (one state per request), so they are not run (the step's boundary commits wrote the block
        boundaries), and every row's accepted count stays 1, which makes vLLM's next pre-step copy move the whole
        running state. Otherwise vLLM's."""
        if not self._ddtree_aligned_states:
            return super()._update_states_after_model_execute(output_token_ids, scheduler_output)
        num_reqs = output_token_ids.size(0)
        self.input_batch.num_accepted_tokens_cpu[:num_reqs] = 1
        self.num_accepted_tokens.gpu[:num_reqs].fill_(1)
        if self.num_accepted_tokens_event is not None:
            self.num_accepted_tokens_event.record(current_stream())

    def _ddtree_commit_graphs_for(self, commit: GdnCommitPlan) -> Optional[CommitGraphs]:
        """The commit graphs on a GPU unless DDTREE_COMMIT_GRAPHS=0 (None: commit layer by layer)."""
        if self._ddtree_commit_graphs is None and self._ddtree_commit_graphs_on:
            if self.device.type == "cuda":
                self._ddtree_commit_graphs = CommitGraphs(
                    self.device,
                    self.max_num_reqs,
                    int(commit.paths.shape[1]),
                    self._ddtree_conv_window,
                    self._ddtree_capture("commit"),
                )
        return self._ddtree_commit_graphs

    def _ddtree_capture(self, graphs: str, pool=None):
        """The CUDA-graph capture of ddtree's step graphs named ``graphs``, their replays' host time counted under
        that name (``graph_launch_ms_per_verify_step``); ``pool``: one memory pool for all of them (None: each
        graph its own)."""
        return timed_replays(cuda_graph_capture(self.device, pool), self.ddtree_stats.graph_launch_seconds, graphs)

    def _target_kv_layers(self) -> List[tuple]:
        """(kv_cache_group_id, kv cache tensor) of each target attention layer, shared caches once."""
        if self._ddtree_kv_layers is None:
            ctx = self.compilation_config.static_forward_context
            layers, seen = [], set()
            for groups in self.attn_groups:
                for group in groups:
                    if not issubclass(group.backend, DDTreeAttentionBackend):
                        continue
                    for name in group.layer_names:
                        cache = ctx[name].kv_cache
                        if isinstance(cache, (list, tuple)):
                            cache = cache[0]
                        if cache.data_ptr() in seen:
                            continue
                        seen.add(cache.data_ptr())
                        layers.append((group.kv_cache_group_id, cache))
            if not layers:
                raise RuntimeError("DDTree: no target attention layer uses the DDTree backend")
            self._ddtree_kv_layers = layers
        return self._ddtree_kv_layers

    def _ddtree_move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves the accepted nodes' K/V (flat scheduled-token indices ``src`` -> ``dst``) in every layer: after a
        step whose walk replayed its graph (``src``/``dst`` are that graph's outputs: one size, fixed addresses), as
        one CUDA graph per step shape and addresses (DDTREE_STEP_GRAPHS); otherwise launch by launch (the host
        walk lists a different number of moves every step; a shape's first walk runs eagerly)."""
        if src.shape[0] == 0:
            return
        if self._ddtree_accept is not None or not self._ddtree_walk_replayed or self._ddtree_kv_move_graphs is None:
            self._ddtree_move_kv_now(src, dst)
            return
        key = (self._ddtree_full_graph, src.data_ptr(), dst.data_ptr(), src.shape[0])
        self._ddtree_kv_move_graphs.run(key, functools.partial(self._ddtree_move_kv_now, src, dst))

    def _ddtree_move_kv_now(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        index = {}  # one block/offset index per KV-cache group and block size, shared by its layers
        for gid, cache in self._target_kv_layers():
            key = (gid, cache.shape[2])
            if key not in index:
                mapping = self.input_batch.block_table[gid].slot_mapping.gpu
                index[key] = kv_move_index(mapping[src], mapping[dst], cache.shape[2])
            apply_kv_moves_indexed(cache, index[key])

    # ---- drafts to the scheduler ------------------------------------------------------------
    def propose_draft_token_ids(self, *args, **kwargs):
        out = super().propose_draft_token_ids(*args, **kwargs)
        self._ddtree_proposed = True
        return out

    def sample_tokens(self, grammar_output):
        self._ddtree_proposed = False
        if hasattr(self, "drafter"):
            self.drafter.last_req_ids, self.drafter.last_drafts = [], []
        try:
            return super().sample_tokens(grammar_output)
        finally:
            # Timed as "stats": host work of every step too, on the engine loop's path like the plan's.
            with self.ddtree_stats.timed("stats"):
                # The statistics of device-walked steps whose counts have landed (the others at a later step, or
                # when the summary is read): no wait here, where the GPU may still commit and draft.
                self._ddtree_count_device_steps(*self._ddtree_counts.landed(wait=False))
                if self._ddtree_what_if_log is not None:
                    self._ddtree_what_if_log.maybe(self.ddtree_stats.what_if, logger.info)
                if self._ddtree_auto is not None:
                    self._ddtree_auto_step()
            self._ddtree_gdn_step = None
            if hasattr(self, "drafter"):
                # A step whose drafter did not run must not leak its row order into the next one.
                self.drafter.context_order = None
                self.drafter.flat_positions = None

    def take_draft_token_ids(self) -> Optional[DraftTokenIds]:
        if not self.num_spec_tokens or not hasattr(self, "drafter"):
            return super().take_draft_token_ids()
        req_ids, drafts = self.drafter.last_req_ids, self.drafter.last_drafts
        self.drafter.last_req_ids, self.drafter.last_drafts = [], []
        if not req_ids:
            return None
        return DraftTokenIds(list(req_ids), [list(d) for d in drafts])

    # ---- ddtree_budget "auto" ---------------------------------------------------------------------
    def _ddtree_auto_step(self) -> None:
        """After a step: whether it is timed (it verified whole trees of one size and captured no graph), the steps
        whose time is known, and the policy's window (a new choice is logged)."""
        auto, timer, plan = self._ddtree_auto, self._ddtree_step_timer, self._ddtree_plan
        if timer is not None:
            tokens = self._ddtree_whole_tree_tokens
            # A step that ran a graph key for the first time (compiled, captured, synchronized) says nothing of
            # the steps after it.
            settled = ShapeGraphs.first_runs == self._ddtree_first_runs_at_start
            timed = tokens and plan is not None and settled
            timer.finish((tokens - 1, int(plan.num_nodes.shape[0])) if timed else None)
            for (budget, trees), ms in timer.landed():
                auto.observe_step_time(budget, trees, ms)
        auto.note_step(int(plan.num_nodes.shape[0]) if plan is not None else 0)
        changed = auto.maybe_decide()
        if changed or (changed is False and auto.decisions == 1):  # every change, and the first choice
            logger.info("DDTree auto: %s", auto.describe())

    def ddtree_warm_up(self) -> None:
        """After vLLM's warm-up and CUDA-graph capture (the worker calls it): under the default (``auto``) a device
        plan whose kernels never ran at start-up (no FULL graph was captured: ``enforce_eager``, PIECEWISE only) is
        dropped, so that nothing compiles them while serving; then ddtree's kernels outside vLLM's warm-up compiled
        (the drafter's packed top-K)."""
        unchecked = self._ddtree_device_planner is not None and not self.ddtree_stats.precaptured_device_plans
        if unchecked and device_plan_mode() == "auto":
            self._ddtree_device_plan_off(
                "its kernels never ran at start-up (no FULL CUDA graph captured)",
                "the device plan's kernels never ran at start-up",
            )
        if hasattr(self, "drafter"):
            self.drafter.warm_up()

    def ddtree_host_pieces(self, on: bool = True) -> bool:
        """Times the pieces inside ddtree's host parts (``DDTreeStats.detail``) from now on, or stops; returns the
        previous setting (``llm.collective_rpc("ddtree_host_pieces", args=(True,))``; the pair bench's
        ``--host-pieces``)."""
        previous, self.ddtree_stats.detail_on = self.ddtree_stats.detail_on, bool(on)
        return previous

    def ddtree_host_profile_start(self) -> None:
        """Profiles ddtree's timed host work function by function until :meth:`ddtree_host_profile_stop`
        (``llm.collective_rpc("ddtree_host_profile_start")``; the benches' ``--host-profile``)."""
        self.ddtree_stats.start_host_profile()

    def ddtree_host_profile_stop(self, limit: int = 40) -> str:
        """The profile since :meth:`ddtree_host_profile_start`, as text (see ``DDTreeStats.stop_host_profile``)."""
        return self.ddtree_stats.stop_host_profile(limit)

    def ddtree_summary(self) -> Dict[str, object]:
        self._ddtree_count_device_steps(*self._ddtree_counts.landed(wait=True))
        # The last step is over (the engine is between generates): its host seconds go where they belong now, so
        # that two summaries bracket exactly the steps between them.
        self.ddtree_stats.close_step(ShapeGraphs.first_runs)
        return dict(
            self.ddtree_stats.summary(),
            whole_tree_gdn_metadata_builds=gdn_metadata.builds,
            graph_capture_failures=ShapeGraphs.capture_failures,
            # ddtree's own step graphs so far and the device memory their captures reserved (each its own pool).
            step_graphs=ShapeGraphs.captures,
            step_graph_reserved_mb=ShapeGraphs.capture_reserved_bytes / 2**20,
            # Device-walked steps left out of the statistics: their ring slot held another step's paths.
            stats_lost_steps=self._ddtree_counts.lost_steps,
            # Proposals whose top-K replayed a graph (DDTREE_TOPK_GRAPHS).
            topk_graph_steps=getattr(getattr(self, "drafter", None), "topk_graph_steps", 0),
            async_scheduling=bool(self.use_async_scheduling),
            # DDTREE_DEVICE_PLAN as start-up decided it ("on", or "off: " and why).
            device_plan=self._ddtree_device_plan_state,
            # Structured outputs (DDTREE_STRUCTURED_OUTPUTS): the tree steps' grammar rows, computed in the scheduler.
            **grammar.STATS.summary(),
        )
