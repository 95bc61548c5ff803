"""DDTree's V1 GPU model runner: vLLM's runner plus the tree steps.

Subclass of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` installed by
:class:`ddtree.vllm.worker.DDTreeWorker`. Per step (async scheduling off):

``_update_states``      drop the tree records of finished/preempted requests.
``_prepare_inputs``     after vLLM's own: build the verification plan of the
                        scheduled trees (:func:`ddtree.vllm.step.plan_verify`),
                        overwrite the tree tokens' positions with
                        ``start + depth`` (slot mapping already computed from the
                        flat positions, so node j's K/V lands at slot start+j),
                        publish the tree-attention inputs.
``execute_model``       vLLM's, then clear the tree-attention inputs.
``_sample``             vLLM calls our rejection sampler
                        (:class:`ddtree.vllm.sampler.DDTreeRejectionSampler`);
                        then move the accepted nodes' K/V into consecutive
                        slots in every target attention layer and hand the
                        drafter the accepted-path row order.
``take_draft_token_ids`` the trees' token lists, one per request (variable
                        length; a request without a tree gets none).
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ddtree.vllm.attention import DDTreeAttentionBackend, TreeAttentionInputs, set_tree_inputs
from ddtree.kernels.paged_tree_attention import apply_kv_moves_paged
from ddtree.vllm.config import ADDITIONAL_CONFIG_KEY, DDTreeConfig
from ddtree.vllm.gdn import GdnCommitPlan, GdnTreeStep, commit_pending, get_gdn_step, set_gdn_step
from ddtree.vllm.step import (
    AcceptPlan,
    VerifyPlan,
    commit_paths,
    conv_commit_index,
    drafter_context_order,
    plan_verify,
)

logger = init_logger(__name__)


class DDTreeStats:
    """Counters beyond vLLM's spec-decode metrics (which stay right on their own)."""

    def __init__(self, depth: int):
        self.steps = 0
        self.trees = 0
        self.nodes = 0
        self.accepted = 0
        self.accepted_per_depth = np.zeros(depth + 1, dtype=np.int64)
        # Host (CPU) seconds DDTree adds, by part; GPU waits are outside the timed blocks.
        self.host_seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, part: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.host_seconds[part] = self.host_seconds.get(part, 0.0) + time.perf_counter() - start

    def observe(self, plan: VerifyPlan, accept: AcceptPlan) -> None:
        acc = accept.accepted.accepted
        self.steps += 1
        self.trees += acc.shape[0]
        self.nodes += int(plan.num_nodes.sum() - plan.num_nodes.shape[0])
        self.accepted += int(acc.sum())
        counts = np.bincount(acc, minlength=self.accepted_per_depth.shape[0])
        # accepted_per_depth[d] = trees whose accepted path reached depth d
        reached = counts[::-1].cumsum()[::-1][: self.accepted_per_depth.shape[0]]
        self.accepted_per_depth[: reached.shape[0]] += reached

    def summary(self) -> Dict[str, object]:
        trees = max(self.trees, 1)
        return {
            "verify_steps": self.steps,
            "trees": self.trees,
            "mean_draft_nodes": self.nodes / trees,
            "mean_acceptance_length": 1.0 + self.accepted / trees,
            "acceptance_rate_per_depth": (self.accepted_per_depth[1:] / trees).tolist(),
            "host_ms_per_verify_step": {
                part: 1e3 * seconds / max(self.steps, 1) for part, seconds in sorted(self.host_seconds.items())
            },
        }


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


def gdn_conv_window(model_config) -> int:
    """``W - 1`` of a hybrid target's GDN conv, from its HF config."""
    text = model_config.hf_text_config
    width = getattr(text, "linear_conv_kernel_dim", None)
    if not isinstance(width, int) or width < 1:
        raise RuntimeError("DDTree: hybrid target without linear_conv_kernel_dim (only GDN hybrids are supported)")
    return width - 1


class DDTreeGPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        data = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if data is None:
            raise RuntimeError("DDTreeGPUModelRunner needs additional_config['ddtree'] (set by the ddtree plugin)")
        self.ddtree_cfg = DDTreeConfig.from_dict(data)
        self._ddtree_plan: Optional[VerifyPlan] = None
        self._ddtree_accept: Optional[AcceptPlan] = None
        self._ddtree_flat_positions: Optional[torch.Tensor] = None
        self._ddtree_proposed = False
        self.ddtree_stats = DDTreeStats(self.ddtree_cfg.draft_len or 0)
        self._ddtree_kv_layers: Optional[List[tuple]] = None
        # Hybrid GDN targets: W - 1 of the conv (0: attention-only target).
        self._ddtree_conv_window = gdn_conv_window(self.model_config) if self.model_config.is_hybrid else 0
        if self.speculative_config is not None and hasattr(self, "drafter"):
            from ddtree.vllm.proposer import DDTreeProposer
            from ddtree.vllm.sampler import DDTreeRejectionSampler

            self.drafter = DDTreeProposer(vllm_config, device, self, self.ddtree_cfg)
            self.drafter.runner = self
            self.rejection_sampler = DDTreeRejectionSampler(self)
            from vllm.utils.torch_utils import PIN_MEMORY

            serve_builtin_logitsprocs(self.input_batch, vllm_config, self.device, PIN_MEMORY)
        logger.info(
            "DDTree: budget %d, drafter depth %s, top-K %s", self.ddtree_cfg.budget, self.ddtree_cfg.draft_len,
            getattr(getattr(self, "drafter", None), "top_k", None),
        )

    # ---- bookkeeping -------------------------------------------------------------------------
    def _update_states(self, scheduler_output):
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if gone and hasattr(self, "drafter"):
            self.drafter.store.discard(gone)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_decode_metadata = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._ddtree_plan = None
        self._ddtree_accept = None
        self._ddtree_flat_positions = None
        set_tree_inputs(None)
        set_gdn_step(None)
        if spec_decode_metadata is None:
            return logits_indices, spec_decode_metadata
        num_reqs = self.input_batch.num_reqs
        with self.ddtree_stats.timed("plan"):
            return self._ddtree_prepare(scheduler_output, num_scheduled_tokens, logits_indices, spec_decode_metadata,
                                        num_reqs)

    def _ddtree_prepare(self, scheduler_output, num_scheduled_tokens, logits_indices, spec_decode_metadata,
                        num_reqs):
        plan = plan_verify(
            self.drafter.store,
            self.input_batch.req_ids[:num_reqs],
            self.input_batch.num_computed_tokens_cpu[:num_reqs],
            num_scheduled_tokens,
            scheduler_output.scheduled_spec_decode_tokens,
            conv_window=self._ddtree_conv_window,
        )
        if plan is None:
            return logits_indices, spec_decode_metadata
        total = scheduler_output.total_num_scheduled_tokens
        # The drafter needs the flat positions; the target sees depth-based ones.
        self._ddtree_flat_positions = self.positions[:total].clone()
        index = torch.from_numpy(plan.token_index).to(self.device, non_blocking=True)
        self.positions[index] = torch.from_numpy(plan.positions).to(self.device, non_blocking=True)
        if self.uses_mrope:
            self._ddtree_tree_mrope_positions(plan, index)
        bits = torch.from_numpy(np.ascontiguousarray(plan.ancestor_bits).view(np.int32)).to(
            self.device, non_blocking=True
        )
        set_tree_inputs(
            TreeAttentionInputs(
                row_start=torch.from_numpy(plan.row_start).to(self.device, non_blocking=True),
                ancestor_bits=bits,
                num_reqs=num_reqs,
                num_tokens=total,
            )
        )
        if self._ddtree_conv_window > 0:
            set_gdn_step(self._ddtree_gdn_step(plan, index, bits, num_reqs, total))
        plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows).to(self.device, non_blocking=True)
        plan.batch_index_gpu = torch.from_numpy(plan.batch_index).to(self.device, non_blocking=True)
        self._ddtree_plan = plan
        return logits_indices, spec_decode_metadata

    def _ddtree_tree_mrope_positions(self, plan: VerifyPlan, index: torch.Tensor) -> None:
        """M-RoPE targets: every section of a tree token is its root's plus the node's depth.

        (For text the three sections of a decode position are equal; taking the
        root's keeps any multimodal offset of the request.)
        """
        sizes = plan.num_nodes
        roots = np.repeat(plan.token_index[plan.trees.node_offsets[:-1]], sizes)
        depth = torch.from_numpy(plan.trees.depths.astype(np.int64)).to(self.device, non_blocking=True)
        root_index = torch.from_numpy(roots).to(self.device, non_blocking=True)
        mrope = self.mrope_positions.gpu
        mrope[:, index] = mrope[:, root_index] + depth.to(mrope.dtype)

    def _ddtree_gdn_step(self, plan: VerifyPlan, index: torch.Tensor, bits: torch.Tensor, num_reqs: int,
                         total: int) -> GdnTreeStep:
        # vLLM's GDN metadata treats requests with num_scheduled == drafts + 1 as
        # spec decodes, in batch order; they must be exactly the tree requests.
        spec_rows = np.flatnonzero(self.num_decode_draft_tokens.np[:num_reqs] >= 0)
        if not np.array_equal(spec_rows, plan.batch_index):
            raise RuntimeError(
                f"DDTree: vLLM's spec-decode rows {spec_rows.tolist()} differ from the tree rows "
                f"{plan.batch_index.tolist()}"
            )
        other = None
        if plan.num_tree_tokens < total:
            keep = np.ones(total, dtype=bool)
            keep[plan.token_index] = False
            other = torch.from_numpy(np.flatnonzero(keep)).to(self.device, non_blocking=True)
        return GdnTreeStep(
            token_index=index,
            other_index=other,
            node_offsets=torch.from_numpy(plan.trees.node_offsets.astype(np.int32)).to(self.device, non_blocking=True),
            ancestor_bits=bits,
            conv_index=torch.from_numpy(plan.conv_index).to(self.device, non_blocking=True),
            num_requests=int(plan.batch_index.shape[0]),
            num_tree_tokens=plan.num_tree_tokens,
        )

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            set_tree_inputs(None)

    # ---- acceptance ----------------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata):
        out = super()._sample(logits, spec_decode_metadata)
        plan, accept = self._ddtree_plan, self._ddtree_accept
        if plan is not None and accept is not None:
            self._ddtree_move_kv(accept)
            self._ddtree_commit_gdn(plan, accept)
            order = drafter_context_order(plan, accept.accepted, int(self._ddtree_flat_positions.shape[0]))
            self.drafter.context_order = torch.from_numpy(order).to(self.device, non_blocking=True)
            self.drafter.flat_positions = self._ddtree_flat_positions
            self.ddtree_stats.observe(plan, accept)
        else:
            self.drafter.context_order = None
            self.drafter.flat_positions = None
        return out

    def _ddtree_commit_gdn(self, plan: VerifyPlan, accept: AcceptPlan) -> None:
        step = get_gdn_step()
        set_gdn_step(None)
        if self._ddtree_conv_window == 0:
            return
        if step is None or not step.pending:
            raise RuntimeError("DDTree: a hybrid target verified trees but no GDN layer recorded its commit")
        paths = accept.accepted.paths
        with self.ddtree_stats.timed("commit_plan"):
            padded, lengths = commit_paths(paths)
            conv_index = conv_commit_index(paths, plan.trees.node_offsets, self._ddtree_conv_window)
        commit = GdnCommitPlan(
            node_offsets=step.node_offsets,
            paths=self._to_device(padded),
            path_lengths=self._to_device(lengths),
            conv_index=self._to_device(conv_index),
        )
        commit_pending(step, commit)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

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

    def _ddtree_move_kv(self, accept: AcceptPlan) -> None:
        if accept.kv_src_token.shape[0] == 0:
            return
        src = torch.from_numpy(accept.kv_src_token).to(self.device, non_blocking=True)
        dst = torch.from_numpy(accept.kv_dst_token).to(self.device, non_blocking=True)
        slots = {}
        for gid, cache in self._target_kv_layers():
            if gid not in slots:
                mapping = self.input_batch.block_table[gid].slot_mapping.gpu
                slots[gid] = (mapping[src], mapping[dst])
            s, d = slots[gid]
            apply_kv_moves_paged(cache, s, d)

    # ---- drafts to the scheduler ------------------------------------------------------------
    def propose_draft_token_ids(self, *args, **kwargs):
        out = super().propose_draft_token_ids(*args, **kwargs)
        self._ddtree_proposed = True
        return out

    def sample_tokens(self, grammar_output):
        if grammar_output is not None and self._ddtree_plan is not None:
            raise RuntimeError("DDTree cannot verify trees under structured outputs (refused at admission; a bug)")
        self._ddtree_proposed = False
        if hasattr(self, "drafter"):
            self.drafter.last_req_ids, self.drafter.last_drafts = [], []
        try:
            return super().sample_tokens(grammar_output)
        finally:
            set_gdn_step(None)
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

    def ddtree_summary(self) -> Dict[str, object]:
        return self.ddtree_stats.summary()
