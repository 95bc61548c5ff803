"""DDTree's proposer: vLLM's DFlash drafter pass, kept as top-K, turned into trees.

One drafter forward per step (vLLM's own ``DFlashProposer`` machinery, called
with the drafter's depth L rather than vLLM's ``num_speculative_tokens``,
which is the tree budget B). The drafter's logits at the L mask positions are
reduced on the GPU to per-position top-K log-probabilities, brought to the host
once as a single ``[batch, L, 2K]`` float32 tensor (log-probs and token ids
bit-cast side by side; with late trees the packing kernel writes it into a
pinned buffer itself, otherwise one copy), and all trees of the batch are built
in one call to the Rust core (:class:`ddtree.vllm.step.TreeStore`).

Conditioning: after a verification the target's rows of a tree request are
in node order; the runner computes the permutation that puts the accepted path
first (:func:`ddtree.vllm.step.drafter_context_order`) and this proposer
applies it, and restores the flat positions the DFlash kernel expects, so the
drafter's context is exactly the accepted path's hidden states.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from ddtree.vllm.streams import current_stream
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.utils import record_function_or_nullcontext

from ddtree.kernels.draft_top_k import pack_top_k
from ddtree.vllm.config import DDTreeConfig, topk_graphs_enabled
from ddtree.vllm.graphs import DraftTopKGraphs
from ddtree.vllm.sliding_drafter import (
    LayerMask,
    check_backends,
    draft_decoder_layers,
    layer_masks,
    masked_metadata,
    set_layer_windows,
    sliding_drafter_enabled,
)
from ddtree.vllm.step import DeferredProposal, TreeStore


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no model-parallel group (single process without distributed init)
        return 0


class DDTreeProposer(DFlashProposer):
    # DDTREE_TOPK_GRAPHS (set in __init__; proposers built without it, as the CPU tests do, launch by launch).
    _topk_graphs_on = False
    _topk_graphs: Optional[DraftTopKGraphs] = None
    # Late trees: the step's views of the pinned buffer (``_late_views_for``) while its drafter pass runs, and whether
    # the pass's top-K kernel wrote its rows there itself (then ``_defer`` queues no copy).
    _late_target: Optional[Tuple[torch.Tensor, np.ndarray, torch.Tensor]] = None
    _packed_on_host = False

    def __init__(self, vllm_config, device, runner, cfg: DDTreeConfig):
        super().__init__(vllm_config, device, runner)
        if cfg.draft_len is None:
            raise ValueError("DDTree: the drafter's depth was not resolved at startup")
        self.cfg = cfg
        self.draft_len = cfg.draft_len
        self.budget = cfg.budget
        vocab = vllm_config.model_config.get_vocab_size()
        self.draft_vocab_size = vocab
        self.draft_logits_dtype = vllm_config.model_config.dtype
        self.top_k = cfg.width(vocab)
        self.store = TreeStore(cfg.budget, cfg.num_threads)
        # Under tensor parallelism every rank drafts (the drafter's logits are
        # gathered, hence identical), but only the first rank's draft tokens
        # reach vLLM's scheduler: it alone builds trees at proposal.
        self.builds_drafts = tensor_parallel_rank() == 0
        self._capture: Optional[torch.Tensor] = None
        self._capturing = False
        # Set by the runner before propose(): hidden-state row order and flat positions.
        self.context_order: Optional[torch.Tensor] = None
        self.flat_positions: Optional[torch.Tensor] = None
        # Draft token lists of the last propose(), in batch order.
        self.last_req_ids: List[str] = []
        self.last_drafts: List[List[int]] = []
        # Late trees (the runner's DDTREE_LATE_TREES): the pinned buffer the top-K kernel writes the host's rows into
        # (not waited for), the event recorded after it, and the device tensor returned to vLLM in place of drafts.
        self._late_host: Optional[torch.Tensor] = None
        self._late_landed = None
        self._late_drafts: Optional[torch.Tensor] = None
        self._late_views: Dict[int, Tuple[torch.Tensor, np.ndarray, torch.Tensor]] = {}
        # DDTREE_TOPK_GRAPHS: the top-K after each drafter pass as CUDA graphs (made at the first proposal).
        self._topk_graphs_on = (
            topk_graphs_enabled(tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size)
            and torch.device(device).type == "cuda"
        )
        self._topk_graphs: Optional[DraftTopKGraphs] = None

    # DDTREE_SLIDING_DRAFTER: the masks of the draft layers whose attention differs from the metadata vLLM builds for
    # all of them, by layer name (empty: none; ``ddtree.vllm.sliding_drafter``).
    _ddtree_layer_masks: Dict[str, LayerMask] = {}

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if sliding_drafter_enabled():
            hf_config = self.draft_model_config.hf_config
            layers = draft_decoder_layers(self.model)
            self._ddtree_layer_masks = layer_masks(layers, hf_config, bool(self.dflash_causal))
            set_layer_windows(layers, self._ddtree_layer_masks)

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        if self._ddtree_layer_masks:  # (at start-up: a backend that would drop the windows is refused here)
            check_backends(self.draft_attn_groups, self._ddtree_layer_masks)

    def build_per_group_and_layer_attn_metadata(self, cad, draft_index: int = 0):
        per_group, per_layer = super().build_per_group_and_layer_attn_metadata(cad, draft_index)
        if self._ddtree_layer_masks:
            per_layer = masked_metadata(per_layer, self._ddtree_layer_masks)
            stats = getattr(getattr(self, "runner", None), "ddtree_stats", None)
            if stats is not None:
                stats.sliding_drafter_steps += 1
        return per_group, per_layer

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not self._capturing:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        graphs = self._draft_top_k_graphs()
        host = None if self._late_target is None else self._late_target[0]
        if graphs is not None:  # (a graph per target: its kernel writes where its capture was told to)
            out = graphs.run(hidden_states, self._top_k_of, host)
        else:
            out = self._top_k_of(hidden_states, host)
        self._capture = out["packed"]
        # Whether the kernel wrote this batch's rows into the host buffer (then the deferral queues no copy).
        written = out.get("host")
        self._packed_on_host = host is not None and written is not None and written.data_ptr() == host.data_ptr()
        return out["top1"], None

    def _top_k_of(self, hidden_states: torch.Tensor, host: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """The drafter's logits ``[batch * L, V]`` reduced to the packed top-K for the host (``packed``: ``[rows,
        2K]`` float32, the ids' int32 bits beside the log-probs, one kernel on a GPU) and each row's top token
        (``top1``, what vLLM's chain would have drafted). ``host`` (late trees: pinned, ``[rows, 2K]``): the kernel
        writes the rows there too, returned as ``host``."""
        logits = self.model.compute_logits(hidden_states)
        values, ids = logits.topk(self.top_k, dim=-1)
        # DDTREE_DEVICE_PLAN (launch by launch): packed straight into the buffer the device plan's graph reads.
        planner = None if self._topk_graphs_on else self._device_planner()
        out = planner.pack_target(logits.shape[0]) if planner is not None else None
        if host is not None and host.shape[0] != logits.shape[0]:
            raise RuntimeError(
                f"DDTree: the drafter gave {logits.shape[0]} rows of logits for a proposal of {host.shape[0]} rows"
            )
        packed = {"packed": pack_top_k(logits, values, ids, out, host), "top1": ids[:, 0]}
        if host is not None:
            packed["host"] = host
        return packed

    def _device_planner(self):
        """The runner's ``DevicePlanner`` (None: DDTREE_DEVICE_PLAN off; also for the tests' stand-in runners)."""
        return getattr(getattr(self, "runner", None), "_ddtree_device_planner", None)

    def _draft_top_k_graphs(self) -> Optional[DraftTopKGraphs]:
        """The top-K graphs under ``DDTREE_TOPK_GRAPHS`` (None: launch by launch), sharing one memory pool."""
        if self._topk_graphs is None and self._topk_graphs_on:
            capture = self.runner._ddtree_capture("draft top-k", pool=torch.cuda.graph_pool_handle())
            itemsize = torch.empty((), dtype=self.draft_logits_dtype).element_size()
            self._topk_graphs = DraftTopKGraphs(capture, self.draft_vocab_size, itemsize)
        return self._topk_graphs

    @property
    def topk_graph_steps(self) -> int:
        """Proposals whose top-K replayed a graph (the runner's summary reports them)."""
        return 0 if self._topk_graphs is None else self._topk_graphs.replayed

    def warm_up(self) -> None:
        """Runs the packed top-K once at start-up on logits of the drafter's shape, so that its kernel is compiled
        before the first request (whose first step would otherwise wait for the compilation)."""
        logits = torch.zeros((self.draft_len, self.draft_vocab_size), dtype=self.draft_logits_dtype, device=self.device)
        values, ids = logits.topk(self.top_k, dim=-1)
        if self.runner.ddtree_late_trees:  # (the kernel's variant that writes the host's rows too: late trees')
            pack_top_k(logits, values, ids, host_out=self._late_views_for(1)[0])
        else:
            pack_top_k(logits, values, ids)

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu=None,
        slot_mappings=None,
    ):
        if self.context_order is not None:
            n = target_hidden_states.shape[0]
            order = self.context_order[:n]
            target_hidden_states = target_hidden_states[order]
            target_token_ids = target_token_ids[order]
            if self.flat_positions is not None:
                target_positions = self.flat_positions[:n]
        self.context_order = None
        self.flat_positions = None

        batch_size = common_attn_metadata.batch_size()
        req_ids = list(self.runner.input_batch.req_ids[:batch_size])
        late = self.runner.ddtree_late_trees
        if late:
            # The drafter's top-K kernel writes this proposal into the pinned buffer the last one is read from: that
            # one leaves it first (usually settled by the plan already; after a device-planned step, which never
            # waits for the top-K, this waits for the GPU to land it: outside the timed part, as every GPU wait of
            # the step is, and with this step's verification queued behind it).
            with record_function_or_nullcontext("ddtree: wait for the last top-K on the host"):
                self.store.settle()
            self._late_target = self._late_views_for(batch_size)
        self._capturing = True
        self._capture = None
        try:
            super().propose(
                self.draft_len,
                target_token_ids,
                target_positions,
                target_hidden_states,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                sampling_metadata,
                mm_embed_inputs=mm_embed_inputs,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                slot_mappings=slot_mappings,
            )
        finally:
            self._capturing = False
            self._late_target = None
            # Restore vLLM's view of the draft length (the budget).
            self.num_speculative_tokens = self.budget
        assert self._capture is not None, "DDTree: the drafter's logits were not captured"
        self.last_req_ids = req_ids
        if late:
            with self.runner.ddtree_stats.timed("defer"):
                return self._defer(req_ids, batch_size)
        # The step's second wait for the GPU (the drafter's tail): its own profiler range.
        with record_function_or_nullcontext("ddtree: wait for the drafter's top-K"):
            host = self._capture.view(batch_size, self.draft_len, 2 * self.top_k).cpu().numpy()
        self._capture = None
        with self.runner.ddtree_stats.timed("build"):
            log_probs = np.ascontiguousarray(host[..., : self.top_k])
            token_ids = np.ascontiguousarray(host[..., self.top_k :]).view(np.int32)
            # A budget schedule picks this step's budget by how many requests draft (every rank sees the same).
            self.last_drafts = self.store.propose(
                req_ids,
                log_probs,
                token_ids,
                build=self.builds_drafts,
                budget=self.runner.ddtree_budget_for(batch_size),
            )
            out = np.zeros((batch_size, self.budget), dtype=np.int64)
            for r, drafts in enumerate(self.last_drafts):
                out[r, : len(drafts)] = drafts
        return torch.from_numpy(out).to(self.device, non_blocking=True)

    def _late_views_for(self, batch_size: int) -> Tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """Late trees, a batch of ``batch_size``: the pinned buffer's rows as a tensor and as ``[R, L, 2K]`` numpy
        (the same memory), and the zeros handed to vLLM in place of drafts. The buffers are made once, for the
        largest batch, and never move: a top-K graph captured with its rows as a target keeps writing there."""
        rows, width = batch_size * self.draft_len, 2 * self.top_k
        if self._late_host is not None and self._late_host.shape[0] < rows:
            # (A batch is at most max_num_seqs requests: the buffer cannot move under a graph that writes it.)
            raise RuntimeError(
                f"DDTree: a proposal of {batch_size} requests x {self.draft_len} positions exceeds the late trees' "
                f"pinned buffer ({self._late_host.shape[0]} rows, made for max_num_seqs={self.runner.max_num_reqs})"
            )
        if self._late_host is None:
            on_gpu = self.device.type == "cuda"
            capacity = max(rows, self.runner.max_num_reqs * self.draft_len)
            self._late_host = torch.empty((capacity, width), dtype=torch.float32, pin_memory=on_gpu)
            self._late_landed = torch.cuda.Event() if on_gpu else None
            self._late_drafts = torch.zeros(
                (self.runner.max_num_reqs, self.budget), dtype=torch.int64, device=self.device
            )
            self._late_views = {}
        views = self._late_views.get(batch_size)
        if views is None:  # (a batch size's views are made once)
            host = self._late_host[:rows]
            views = self._late_views[batch_size] = (
                host,
                host.numpy().reshape(batch_size, self.draft_len, width),
                self._late_drafts[:batch_size],
            )
        return views

    def _defer(self, req_ids: List[str], batch_size: int) -> torch.Tensor:
        """Late trees: the top-K goes to the host without a wait and the trees are built at the next verification
        (``plan_verify``); vLLM's scheduler gets placeholder drafts of each tree's size. Returns zeros in place of
        the drafts: vLLM keeps them, and under asynchronous scheduling writes them into the next step's input ids,
        where the runner writes the tree tokens over them."""
        # Every rank: each builds its trees at verification from the same gathered top-K.
        self.store.settle()  # (the caller settled the last deferred proposal: a no-op then)
        views = self._late_views_for(batch_size)
        on_host, self._packed_on_host = self._packed_on_host, False
        stats = self.runner.ddtree_stats
        with stats.detail("defer: copy"):  # (only the event's record where the kernel wrote the host's rows)
            if not on_host:
                views[0].copy_(self._capture, non_blocking=True)
            if self._late_landed is not None:
                self._late_landed.record(current_stream())  # (torch's own lookup of the stream: ~22 us more here)
        packed, self._capture = self._capture, None
        with stats.detail("defer: store"):
            proposal = DeferredProposal(views[1], self.top_k, self._late_landed)
            self.last_drafts = self.store.defer(req_ids, proposal, budget=self.runner.ddtree_budget_for(batch_size))
        planner = self._device_planner()
        if planner is not None:  # DDTREE_DEVICE_PLAN: the next step may build these trees on the device
            with stats.detail("defer: keep top-K"):
                planner.keep_top_k(packed, proposal.req_ids)
        return views[2]
