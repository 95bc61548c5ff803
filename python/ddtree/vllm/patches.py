"""Every change DDTree makes to vLLM, in one place.

Supported vLLM: :data:`SUPPORTED` (0.25.x). Other versions are refused with a
clear message: the adapter subclasses private parts of vLLM's V1 model runner
and DFlash proposer whose signatures change between minor releases.

What is patched, and why (all applied by :func:`apply`, idempotent):

1. ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` (wrapped):
   vLLM has no way to register a speculative method and its
   ``SpeculativeConfig`` rejects unknown keys, so ``method: "ddtree"`` is
   translated before vLLM parses it (``ddtree.vllm.config.parse_spec_config``:
   method ``dflash`` with ``num_speculative_tokens`` = budget, DDTree settings
   in ``additional_config["ddtree"]``), the engine settings DDTree needs are
   applied or refused (``engine_overrides``: no async scheduling, no prefix
   caching, CUSTOM attention backend, DDTree's worker class, V1 runner;
   ``cudagraph_mode_choice``: vLLM's FULL_AND_PIECEWISE unless the user chose
   another served mode or eager mode), and the created ``VllmConfig`` is validated (attention-only target, drafter
   depth resolved from its ``block_size``, a ``long_prefill_token_threshold``
   that holds a tree, hybrid prefix caching only on a vLLM whose state-block
   accounting it follows: below ``HYBRID_ALIGN_CHANGED_IN``). vLLM 0.33's
   ``--spec-method/--spec-model/--spec-tokens`` are merged into the dict first
   (``_fold_spec_shorthands``). ``VLLM_USE_V2_MODEL_RUNNER`` and
   ``VLLM_USE_BREAKABLE_CUDAGRAPH`` are set to 0 where unset (vLLM turns either
   on by itself for some configurations; process-wide), and refused at 1. A
   later non-ddtree engine in the same process is otherwise untouched.

   1b. Under asynchronous scheduling (``DDTREE_ASYNC_SCHEDULING``, on by default with one GPU) vLLM's
   scheduler, not the runner, sets the next step's placeholder drafts per
   request: ``num_speculative_tokens`` (the largest budget). With a budget
   schedule the created config's ``num_speculative_tokens_per_batch_size``
   (vLLM's dynamic speculative decoding, read in V1 by its scheduler only) is
   set to the schedule (``config.dynamic_sd_schedule``), and
   ``VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`` (wrapped) leaves a
   ddtree engine's graph mode alone: vLLM switches V1 dynamic-speculation
   engines to PIECEWISE graphs (also in the engine process, which re-runs
   ``VllmConfig.__post_init__``: setting the field late was not enough, the
   first GPU run replayed no FULL graph), where the ddtree runner replays FULL
   graphs of each budget's trees (patch 8). Upstream fix: the same schedule
   read by the V1 runner's graph dispatch (V2 has it).

   1c. ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (wrapped): for
   ``ddtree_budget: "auto"`` under asynchronous scheduling, the scheduler's
   dynamic speculation lookup becomes the runner's live one
   (``auto_budget.attach_scheduler``; runner and scheduler share the engine
   process with one GPU), so the budgets the runner re-decides reach the next
   step the scheduler places. Upstream fix: a way for the model runner to
   report its chosen draft length per batch size to the scheduler.
2. ``vllm.v1.engine.input_processor.InputProcessor._validate_params``
   (wrapped): requests whose sampling the tree cannot serve exactly
   (per-request logits processors; structured outputs unless
   ``DDTREE_STRUCTURED_OUTPUTS=1``, and then those patch 12 does not cover)
   are rejected at admission with the reason, only for ddtree engines; and
   ``SamplingParams._validate_spec_decode`` (wrapped) no longer refuses
   ``min_p`` and ``logit_bias`` while a ddtree engine admits a request
   (vLLM's chain sampler ignores them at draft positions; DDTree's per-node
   sampler applies them). Under a speculative config vLLM also builds no
   logits processor for either; the ddtree runner adds them to its batch
   (``runner.serve_builtin_logitsprocs``, not a patch: its own subclass).
3. ``register_backend(AttentionBackendEnum.CUSTOM, ...)``: the CUSTOM
   attention backend is DDTree's tree-attention backend (vLLM's own
   registration API; only selected when the engine asks for CUSTOM).
4. ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (module attribute,
   swapped only while :class:`ddtree.vllm.worker.DDTreeWorker` builds its
   runner, see :func:`runner_class_swapped`): vLLM's worker imports the runner
   class lazily from that module; the swap makes it build
   :class:`ddtree.vllm.runner.DDTreeGPUModelRunner`. On vLLM 0.33 the worker
   builds it in ``Worker._make_model_runner``, which ``DDTreeWorker``
   overrides instead (no swap there).

5. Hybrid Gated-DeltaNet targets (Qwen3.5/3.6, Qwen3-Next), one recurrent
   state slot per request instead of vLLM's ``num_speculative_tokens + 1``
   (with a tree, ``num_speculative_tokens`` is the budget: 65 slots of ~3 MB
   per GDN layer per request at budget 64). DDTree verifies without writing
   any per-node state and commits the accepted path into the request's one
   slot (``ddtree.vllm.gdn``), so only a ddtree engine is changed:

   a. ``MambaBase.get_kv_cache_spec`` (wrapped): ``num_speculative_blocks=0``
      (one state block per request);
   b. ``GatedDeltaNetAttention.__init__`` (wrapped): ``num_spec = 0``, so the
      layer's conv state is ``W - 1`` wide instead of ``W - 1 + budget``;
   c. ``Platform._align_hybrid_block_size`` (wrapped) and
      ``MambaStateShapeCalculator.gated_delta_net_state_shape`` (wrapped): while
      the former aligns a ddtree engine's page sizes, the latter computes the
      same single-slot conv shape as (b);
   d. ``QwenGatedDeltaNetAttention._forward_core`` (wrapped, in the worker
      process only, see :func:`apply_worker_patches`): steps that verify trees
      run the tree tokens through ``ddtree.vllm.gdn.verify_tree_tokens`` and
      every other token (prefills, chunks) through vLLM's own code with the
      metadata restricted to them; steps without trees are vLLM's code
      untouched;
   e. ``QwenGatedDeltaNetAttention.__init__`` (wrapped): vLLM 0.33's fused
      CUDA spec-decode kernel (``VLLM_GDN_DECODE_KERNEL=cuda``, its default)
      verifies a chain in one op that never calls ``_forward_core``, so tree
      tokens would go through a chain's recurrence (silently wrong outputs).
      A ddtree engine's layers take vLLM's Triton path instead, as vLLM itself
      does where the fused kernel is unsupported (0.25 has no such kernel: a
      no-op there). Upstream: a spec-decode kernel that takes a tree (or a
      per-layer hook the fused op calls).

6. ``VllmConfig._set_max_num_scheduled_tokens`` (wrapped): vLLM keeps
   ``(num_speculative_tokens - 1) * max_num_seqs`` of ``max_num_batched_tokens``
   free for a parallel drafter's mask slots. For a ddtree engine
   ``num_speculative_tokens`` is the budget, but the drafter drafts only its
   depth L (``proposer.py``), so vLLM kept far too much: budget 256 with
   ``max_num_seqs=32`` and 8352 batched tokens left 192 tokens a step, one tree
   at a time (measured: ddtree 256 ran 145 ms steps at batch 8, 721 ms at 32),
   and budget 64 with vLLM's default ``max_num_seqs`` refused to start. The
   reservation is computed with L, what vLLM's own DFlash chain of depth L keeps.
   Upstream fix: a per-method ``max_num_new_slots_for_drafting`` that knows
   the drafter's depth differs from the verified tokens.

7. Inside patch 6, the batch limits the user left to vLLM's defaults are
   fitted to whole trees (``config.fit_batch_limits``): vLLM's default
   ``max_num_seqs`` (1024 for ``vllm serve`` on an H200) with its 8192 batched
   tokens makes vLLM's own check fail at start-up (``max_num_scheduled_tokens
   is set to -6144``) -- as it does for vLLM's DFlash chain of depth 15 --, so
   fewer sequences (or, when the user fixed them, more batched tokens) are
   used, logged with the reason. User-set limits that hold no tree are refused
   with values that work. Upstream fix: defaults derived from the speculative
   config.

8. ``VllmConfig._set_cudagraph_sizes`` (wrapped): when the user chose no
   capture sizes, a ddtree engine captures vLLM's defaults plus every whole
   number of trees ``k * (budget + 1)`` (``config.tree_capture_sizes``). vLLM's
   default stops at 512 tokens, seven trees of budget 64; bigger tree steps
   would run without graphs. Upstream fix: capture sizes per uniform query
   length (vLLM's V2 runner captures one set per query length).

   With a budget schedule the runner subclass goes further (not applied by
   :func:`apply`: ``DDTreeGPUModelRunner._ddtree_add_schedule_graphs``): V1's
   CUDA-graph dispatcher knows one uniform query length, ``budget + 1``, and
   rounds every capture size to a multiple of it, so the schedule's smaller
   trees could only replay PIECEWISE graphs (their steps at batch 8 cost as
   much as 65-token trees'). After vLLM resolves the graph modes, the runner
   adds the sizes of ``n`` whole trees of each smaller budget at the batch
   sizes that pick it (``config.schedule_tree_graphs``), a PIECEWISE key for
   each new size and a FULL key ``(n * tree tokens, n, uniform)`` per graph,
   and sets the dispatcher's and its own ``uniform_decode_query_len`` to the
   graph's tree tokens for the length of one capture (``_warmup_and_capture``)
   or one dispatch (``_determine_batch_execution_and_padding``). Upstream fix:
   FULL graphs keyed by query length (V2's per-query-length graph sets).

9. ``PrometheusStatLogger.__init__`` and ``LoggingStatLogger.__init__``
   (wrapped; they run in the front-end process, where vLLM's stat loggers
   live): vLLM counts every tree node as a draft token, so its "acceptance
   rate" is per node (2.5% for a run accepting 2.6 tokens per tree), and sizes
   its per-position counters and log line by ``num_speculative_tokens``, the
   budget (64 or 256 positions, all from the drafter's depth L on always 0).
   For a ddtree engine the Prometheus logger's spec-decode part is
   ``ddtree.vllm.metrics``'s subclass of vLLM's ``SpecDecodingProm`` (vLLM's
   counters unchanged, plus ``vllm:spec_decode_ddtree_*``: trees, partial
   trees, tree nodes, accepted tokens by depth 1..L, budget and depth gauges)
   and the log line's is ``DDTreeSpecDecodingLogging`` (per-depth rates over
   L, the per-node ratio named as such). Both read only the
   ``SpecDecodingStats`` fields that already reach the front end; the engine
   core is untouched. Upstream fix: spec-decode stats that know a method's
   verified tokens (tree nodes) differ from its depth, e.g. per-position
   counters sized by the drafter's depth and a per-method stats hook.

10. ``GDNAttentionMetadataBuilder.build`` (wrapped, in the worker process of
    a hybrid target only, see :func:`apply_worker_patches`): in a step where
    every request verifies a tree, the GDN metadata is written by
    ``ddtree.vllm.gdn_metadata.whole_tree_metadata`` -- the same buffers and
    values as vLLM's FULL-graph branch, without the host-side classification
    (masks, ``.item()``, ``nonzero``) that vLLM repeats for each of the
    target's GDN KV-cache groups (10 per step at Qwen3.6-27B's shape). vLLM's chain
    hides that host work behind the GPU with asynchronous scheduling, which a
    ddtree step cannot use, so there it is GPU idle time. Every other step is
    vLLM's build. ``DDTREE_WHOLE_TREE_GDN_METADATA=0`` leaves every build to
    vLLM. Upstream fix: a GDN builder that supports
    ``update_block_table`` (the groups differ only in their state indices).
    Installed on vLLM 0.25.x only (``GDN_METADATA_CHANGED_IN``): it writes
    that builder's buffers.

11. ``vllm.model_executor.models.qwen3_dflash._resolve_layer_attention`` (wrapped, in the worker process, only
    under ``DDTREE_SLIDING_DRAFTER=1``, experimental): a drafter with sliding-window and full-attention layers (the
    released Qwen3.6-27B drafter) is built with no per-layer window, so every draft layer keeps a full-attention
    KV spec and the drafter one KV-cache group (vLLM's V1 proposer asserts one); the sliding layers get their
    causality and window through their attention metadata (``DDTreeProposer``, ``ddtree.vllm.sliding_drafter``).
    vLLM 0.25.1 refuses such a drafter there. Upstream fix: per-layer causal metadata in the V1 proposer (vLLM
    0.33 has it on its V2 runner only, with one KV group per layer kind). On 0.33 the window is set on the sliding
    layers too (its FlashAttention reads it there), and the config half, ``VllmConfig._dflash_needs_multi_kv_group``
    (wrapped where vLLM has it, every process), answers False for a ddtree engine: vLLM's V1 check would refuse the
    drafter before ddtree's own check can run it in one group (under the switch) or refuse it naming the switch.

12. Structured outputs (admitted under ``DDTREE_STRUCTURED_OUTPUTS=1``, xgrammar, one GPU), three ``Scheduler``
    methods (wrapped, ddtree engines only): (a) ``get_grammar_bitmask``: vLLM fills a structured request's rows for a
    chain (row ``i`` after drafts ``< i``); a tree needs node ``j``'s row to be the mask after the tokens on its root
    path. The runner publishes each step's trees (``grammar.publish_step``, at the end of ``execute_model``, which
    returns before vLLM asks for the masks on the same thread) and the rows come from one xgrammar walk of each tree
    (``grammar.fill_step_bitmask``), in vLLM's layout, so vLLM's ``apply_grammar_bitmask`` puts them on the nodes'
    logits rows. (b) ``update_draft_token_ids`` (synchronous) cuts a structured request's drafts at the grammar's
    first refusal, which leaves a tree's placeholder slots empty: a ddtree engine's drafts are scheduled as they are.
    (c) ``update_draft_token_ids_in_output`` (asynchronous, a step whose sampling waits for the last output) would
    replace the step's placeholders by a checked chain and count the rest invalid: a ddtree step's placeholders are
    its trees' slots and stay. Upstream fix: a speculator hook that computes its own grammar rows and checks its
    own drafts. (vLLM 0.33, found by its fields: (a) writes its blocks of ``1 + num_speculative_tokens`` rows a
    request and ``num_acceptable_drafts``; (b) turns off its ``validate_tokens`` instead.)

13. Prefix caching with a hybrid target (``DDTREE_HYBRID_PREFIX_CACHING=1``, vLLM's mamba cache mode "align"; the
    worker's half is the runner's: boundary commits, accepted counts kept at 1, ``ddtree.vllm.mamba_align``): (a)
    ``MambaManager.remove_skipped_blocks`` (wrapped): a ddtree engine's state-block managers free ``2 * (budget + 1)``
    tokens later than vLLM, whose optimistic count would free the block before the running one while a tree step may
    still write its boundary state there; (c) ``MambaManager.find_longest_cache_hit`` (wrapped): with DFlash (an
    "eagle" drafter) vLLM drops one matched block from the attention groups' hits but not from the state group's, so a
    hit could end a block past the attention K/V; for a ddtree engine (``num_speculative_blocks`` 0) the state lookup
    stops a block earlier; (b) inside 1c's ``Scheduler.__init__``: sets (a)'s lag and refuses a block size that cannot
    hold a step's tokens. A manager of another engine is unchanged. Upstream fix: (a) per-method state-block retention; (c)
    the state lookup honouring ``drop_eagle_block`` (vllm-project/vllm#48375, #57128; 0.33's lookup does, and (c) is
    installed below ``STATE_LOOKUP_FIXED_IN`` only).

Not patched: vLLM's sampler, DFlash proposer and attention backends are used through subclasses (``runner.py``,
``proposer.py``, ``sampler.py``, ``attention.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import os
import time
from typing import Any, Optional, Tuple

from ddtree.drafter_config import UnsupportedDrafterError, check_drafter_layers
from ddtree.vllm.sliding_drafter import (
    SlidingDrafterError,
    check_drafter_config,
    is_mixed,
    resolve_in_one_kv_group,
    sliding_drafter_enabled,
)
from ddtree.errors import DDTreeError
from ddtree.vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    METHOD,
    V2_RUNNER_ENV,
    BREAKABLE_GRAPHS_ENV,
    check_long_prefill_threshold,
    field_names,
    DDTreeConfig,
    HYBRID_PREFIX_CACHING_ENV,
    DDTreeConfigError,
    check_environment,
    check_target,
    cudagraph_mode_choice,
    dynamic_sd_schedule,
    engine_overrides,
    fit_batch_limits,
    hybrid_prefix_caching_enabled,
    override_reason,
    parse_spec_config,
    resolve_draft_len,
    structured_outputs_refusal,
    structured_outputs_start_up_warning,
    tree_capture_sizes,
    unsupported_sampling_reasons,
    whole_tree_gdn_metadata_enabled,
)

SUPPORTED = ((0, 25, 0), (0, 26, 0))  # [min, max)
_APPLIED = False
_MARK = "__ddtree_wrapped__"


def _wrap_once(owner: Any, name: str, make_wrapper) -> None:
    """Replaces ``owner.name`` by ``make_wrapper(original)``, once (marked, so applying again is a no-op).

    A classmethod stays a classmethod: ``make_wrapper`` then gets and returns the underlying function.
    """
    attribute = owner.__dict__.get(name)
    is_classmethod = isinstance(attribute, classmethod)
    original = attribute.__func__ if is_classmethod else getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, classmethod(wrapper) if is_classmethod else wrapper)


class UnsupportedVLLMVersion(DDTreeError, RuntimeError):
    pass


def parse_version(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def vllm_version(version: Optional[str] = None) -> str:
    """``version``, or the installed vLLM's when None."""
    if version is None:
        import vllm

        version = vllm.__version__
    return version


def vllm_below(limit: tuple, version: Optional[str] = None) -> bool:
    """Whether ``version`` (default: the installed vLLM's) is below ``limit``: where a patch follows vLLM's version."""
    return parse_version(vllm_version(version)) < limit


def check_version(version: str) -> None:
    v = parse_version(version)
    lo, hi = SUPPORTED
    if not (lo <= v < hi):
        raise UnsupportedVLLMVersion(
            f"ddtree's vLLM adapter supports vLLM >= {'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))}; "
            f"found vLLM {version}. Install a supported vLLM (pip install 'ddtree[vllm]') or uninstall ddtree's "
            f"plugin with VLLM_PLUGINS excluding 'ddtree'."
        )


def _log():
    from ddtree.vllm.log import get_logger

    return get_logger(__name__)


# ---- 1. configuration --------------------------------------------------------------------------
#: vLLM 0.33's speculative shorthands (``EngineArgs`` field, flag, ``speculative_config`` key). vLLM merges them into
#: the dict inside ``create_engine_config``, after ddtree's translation: for a ddtree engine they are merged first.
SPEC_SHORTHANDS = (
    ("spec_method", "--spec-method", "method"),
    ("spec_model", "--spec-model", "model"),
    ("spec_tokens", "--spec-tokens", "num_speculative_tokens"),
)


def _fold_spec_shorthands(args: Any) -> None:
    """``--spec-method ddtree`` (with ``--spec-model``, and ``--spec-tokens`` for the drafter's depth) merged into
    ``speculative_config`` as vLLM merges them, so that the translation sees a ddtree config; a key given both ways
    is refused, as vLLM refuses it. Anything else is left to vLLM."""
    spec = args.speculative_config if isinstance(args.speculative_config, dict) else None
    method = getattr(args, "spec_method", None) or (spec or {}).get("method")
    if method != METHOD:
        return
    merged = dict(spec or {})
    for attr, flag, key in SPEC_SHORTHANDS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if key in merged:
            raise DDTreeConfigError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        merged[key] = value
        setattr(args, attr, None)
    args.speculative_config = merged


def _translate_engine_args(args: Any) -> Optional[DDTreeConfig]:
    """Rewrites a ddtree EngineArgs in place; returns its DDTree settings (None: not ddtree)."""
    _fold_spec_shorthands(args)
    spec = args.speculative_config
    if not isinstance(spec, dict) or spec.get("method") != METHOD:
        return None
    vllm_spec, cfg = parse_spec_config(spec)
    changes = engine_overrides(args, cfg=cfg)
    for attr, value in changes.items():
        setattr(args, attr, value)
        tensor_parallel_size = getattr(args, "tensor_parallel_size", 1) or 1
        _log().info("DDTree: %s=%r (%s)", attr, value, override_reason(attr, os.environ, tensor_parallel_size, cfg))
    _choose_cudagraph_mode(args)
    # Unset, vLLM may turn either on by itself. (Process-wide: another engine made later in the same process keeps
    # them off too, as if its user had set them to 0.)
    for env in (V2_RUNNER_ENV, BREAKABLE_GRAPHS_ENV):
        if os.environ.get(env) is None:
            os.environ[env] = "0"
    args.speculative_config = vllm_spec
    extra = dict(args.additional_config or {})
    extra[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    args.additional_config = extra
    return cfg


def _choose_cudagraph_mode(args: Any) -> None:
    """vLLM's default CUDA-graph mode made explicit, unless the user chose eager mode or a mode ddtree serves
    (mixed-batch FULL is refused)."""
    compilation = getattr(args, "compilation_config", None)
    if compilation is None or not hasattr(compilation, "cudagraph_mode"):
        return
    requested = compilation.cudagraph_mode
    mode = cudagraph_mode_choice(getattr(requested, "name", requested), getattr(args, "enforce_eager", None))
    if mode is None:
        return
    from vllm.config.compilation import CUDAGraphMode

    compilation.cudagraph_mode = CUDAGraphMode[mode]
    _log().info("DDTree: cudagraph_mode=%s (whole-tree steps replay FULL graphs, other steps PIECEWISE)", mode)


def _drafter_block_size(draft_hf_config: Any) -> Optional[int]:
    for cfg in (draft_hf_config, getattr(draft_hf_config, "text_config", None)):
        if cfg is None:
            continue
        block = getattr(cfg, "block_size", None)
        if isinstance(block, int):
            return block
        dflash = getattr(cfg, "dflash_config", None) or {}
        if isinstance(dflash, dict) and isinstance(dflash.get("block_size"), int):
            return dflash["block_size"]
    return None


def validate_vllm_config(vllm_config: Any, cfg: DDTreeConfig) -> DDTreeConfig:
    """Checks the created VllmConfig and resolves the drafter depth; returns the final settings."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dflash":
        raise DDTreeConfigError("method 'ddtree' needs a DFlash drafter (vLLM did not detect one)")
    draft_hf = spec.draft_model_config.hf_config
    where = f"speculative_config model {spec.draft_model_config.model!r}"
    layer_types = getattr(draft_hf, "layer_types", None)
    try:
        if sliding_drafter_enabled() and is_mixed(layer_types):
            check_drafter_config(draft_hf)  # (patch 11: run as trained)
        else:
            check_drafter_layers(where, layer_types, getattr(draft_hf, "use_sliding_window", None))
    except (UnsupportedDrafterError, SlidingDrafterError) as error:  # one error type for every refused configuration
        raise DDTreeConfigError(f"{where}: {error}" if isinstance(error, SlidingDrafterError) else str(error)) from None
    cfg = resolve_draft_len(cfg, _drafter_block_size(draft_hf))
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None)
    sliding = model.get_sliding_window()
    if text is not None and getattr(text, "use_sliding_window", True) is False:
        sliding = None  # Qwen-style configs keep a window size with the feature switched off
    check_target(
        architecture=str(getattr(model, "architecture", "")),
        mamba_cache_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none")),
        is_hybrid=bool(getattr(model, "is_hybrid", False)),
        uses_mrope=bool(getattr(model, "uses_mrope", False)),
        sliding_window=sliding,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        vocab_size=model.get_vocab_size(),
        cfg=cfg,
        use_v2_model_runner=bool(vllm_config.use_v2_model_runner),
        has_logits_processors=bool(getattr(model, "logits_processors", None)),
        logprobs_mode=str(getattr(model, "logprobs_mode", "raw_logprobs")),
        prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)),
        kv_connector=getattr(vllm_config, "kv_transfer_config", None) is not None,
        hybrid_prefix_caching=hybrid_prefix_caching_enabled(),
    )
    if spec.num_speculative_tokens != cfg.budget:
        raise DDTreeConfigError("internal: vLLM's num_speculative_tokens must equal the ddtree budget")
    check_long_prefill_threshold(
        int(getattr(vllm_config.scheduler_config, "long_prefill_token_threshold", 0) or 0), cfg.budget
    )
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    return cfg


def _wrap_create_engine_config(engine_args_cls) -> None:
    _wrap_once(engine_args_cls, "create_engine_config", _create_engine_config_wrapper)


def _create_engine_config_wrapper(original):
    def create_engine_config(self, *args, **kwargs):
        cfg = _translate_engine_args(self)
        if cfg is None:
            extra = getattr(self, "additional_config", None)
            if isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra:
                raise DDTreeConfigError(
                    "additional_config['ddtree'] is set by the ddtree plugin; use "
                    "speculative_config={'method': 'ddtree', ...} instead"
                )
            return original(self, *args, **kwargs)
        # Every DDTREE_* setting read once here: a value none takes is refused before anything loads.
        for warning in check_environment():
            _log().warning("DDTree: %s", warning)
        # Which batch limits the user set (vLLM fills the others with its defaults inside original):
        # patch 6 fits only those, so the defaults serve whole trees instead of failing vLLM's check.
        token = _USER_BATCH_LIMITS.set(
            (getattr(self, "max_num_seqs", None) is not None, getattr(self, "max_num_batched_tokens", None) is not None)
        )
        # (vLLM writes its default into the arguments: whether the user set it is known only before.)
        prefix_caching_unset = getattr(self, "enable_prefix_caching", None) is None
        try:
            vllm_config = original(self, *args, **kwargs)
            if prefix_caching_unset and _hybrid_prefix_caching_by_vllms_default(vllm_config):
                # vLLM's own default turned prefix caching on for a hybrid target (0.25 does not; 0.33 does): without
                # DDTREE_HYBRID_PREFIX_CACHING ddtree serves the target as a user who turned it off would be served.
                _log().info(
                    "DDTree: prefix caching off for this hybrid target (vLLM's default turned it on; %s=1 serves it "
                    "with trees, experimental)",
                    HYBRID_PREFIX_CACHING_ENV,
                )
                self.enable_prefix_caching = False
                vllm_config = original(self, *args, **kwargs)
        except ValueError as error:
            # pydantic wraps an error raised inside VllmConfig.__post_init__ (patch 7) in its own
            # ValidationError; the user gets ddtree's message as it was raised.
            cause = _config_error_in(error)
            if cause is None:
                raise
            raise cause from None
        finally:
            _USER_BATCH_LIMITS.reset(token)
        cfg = validate_vllm_config(vllm_config, cfg)
        _schedule_for_async_scheduler(vllm_config, cfg)
        structured = _structured_outputs_start_up_warning(vllm_config)
        if structured is not None:
            _log().warning("DDTree: %s", structured)
        if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align":
            check_hybrid_prefix_caching_served()
            _log().warning(
                "DDTree: prefix caching with a hybrid target (%s=1) is experimental: its boundary commits are tested "
                "on CPU and were exact in one GPU run on the test pair (docs/prefix-caching.md)",
                HYBRID_PREFIX_CACHING_ENV,
            )
        _log().info("DDTree enabled: %s", cfg)
        return vllm_config

    return create_engine_config


def _hybrid_prefix_caching_by_vllms_default(vllm_config) -> bool:
    """Whether ``vllm_config``, made with ``enable_prefix_caching`` left to vLLM, caches a hybrid target's prefixes
    while ddtree does not serve that (``DDTREE_HYBRID_PREFIX_CACHING`` off)."""
    return (
        bool(getattr(vllm_config.model_config, "is_hybrid", False))
        and bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        and not hybrid_prefix_caching_enabled()
    )


def _keep_full_graphs_under_a_schedule(original):
    """1b: vLLM switches V1 engines with a dynamic speculation schedule to PIECEWISE graphs (its V1 dispatch knows one
    query length), also in the engine process, which re-runs ``VllmConfig.__post_init__``; a ddtree runner
    dispatches each budget's trees to FULL graphs of their own, so a ddtree engine keeps its mode."""

    def _maybe_override_dynamic_sd_cudagraph_mode(self):
        if is_ddtree_config(self):
            return None
        return original(self)

    return _maybe_override_dynamic_sd_cudagraph_mode


def _schedule_for_async_scheduler(vllm_config, cfg: DDTreeConfig) -> None:
    """1b: under asynchronous scheduling vLLM's scheduler places the next step's drafts; a budget schedule tells
    it how many, as vLLM's dynamic speculative decoding schedule."""
    if cfg.varies_by_batch_size and vllm_config.scheduler_config.async_scheduling:
        vllm_config.speculative_config.num_speculative_tokens_per_batch_size = dynamic_sd_schedule(
            cfg, vllm_config.scheduler_config.max_num_seqs
        )


def _scheduler_set_up_for_trees(original):
    """1c: ``ddtree_budget: "auto"`` under asynchronous scheduling: the scheduler reads the runner's live budget
    lookup (``auto_budget.AutoBudget.lookup``, one process with one GPU) instead of the copy it built from the
    config at start-up. 13b: a hybrid target's state blocks freed later (prefix caching)."""

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        _lag_state_frees_for_trees(self, vllm_config)
        settings = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        if settings.get("auto") and getattr(self, "dynamic_sd_lookup", None) is not None:
            from ddtree.vllm import auto_budget

            if not auto_budget.attach_scheduler(self):
                _log().warning(
                    "DDTree auto budget: the model runner is not in the scheduler's process; every batch size keeps "
                    "the largest budget"
                )

    return __init__


# ---- 13. prefix caching for hybrid targets -----------------------------------------------------------
def _lag_state_frees_for_trees(scheduler, vllm_config) -> None:
    """13b: a ddtree engine whose hybrid target caches prefixes (mamba cache mode "align") frees state blocks
    ``mamba_align.free_lag_tokens`` later (13a), and refuses a block size that cannot hold a step's tokens."""
    cache = getattr(vllm_config, "cache_config", None)
    if not is_ddtree_config(vllm_config) or getattr(cache, "mamba_cache_mode", "none") != "align":
        return
    from ddtree.vllm.mamba_align import block_size_problem, free_lag_tokens

    budget = int(vllm_config.speculative_config.num_speculative_tokens)
    for group in scheduler.kv_cache_config.kv_cache_groups:
        if getattr(group.kv_cache_spec, "mamba_cache_mode", None) == "align":
            problem = block_size_problem(group.kv_cache_spec.block_size, budget)
            if problem is not None:
                raise DDTreeConfigError(f"method 'ddtree': {problem}")
    set_state_block_free_lag(scheduler.kv_cache_manager, free_lag_tokens(budget))


def set_state_block_free_lag(kv_cache_manager, lag: int) -> None:
    """13b: every state-block manager of ``kv_cache_manager`` frees ``lag`` tokens later (13a reads it)."""
    for manager in kv_cache_manager.coordinator.single_type_managers:
        if getattr(manager, "mamba_cache_mode", None) == "align":
            manager._ddtree_free_lag = int(lag)


#: The first vLLM whose coordinator no longer extends the state group's lookup by the dropped eagle block (0.25.1
#: does, 0.33.0 does not: "No margin for mamba" in ``v1/core/kv_cache_coordinator.py``); 13c is installed below it.
STATE_LOOKUP_FIXED_IN = (0, 33, 0)


def install_state_block_patches(vllm_version: Optional[str] = None) -> None:
    """13a and 13c on vLLM's ``MambaManager`` (idempotent; neither changes a manager of another engine); 13c only
    on a vLLM whose state lookup still has the bug it works around."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    _wrap_once(MambaManager, "remove_skipped_blocks", _lagged_state_frees)
    if vllm_below(STATE_LOOKUP_FIXED_IN, vllm_version):
        _wrap_once(MambaManager, "find_longest_cache_hit", _state_hit_within_the_dropped_block)


def _state_hit_within_the_dropped_block(original):
    """13c: with a drafter that reads the target's hidden states (vLLM's "eagle" family, DFlash included), vLLM
    matches one block more than it keeps and drops that block from the attention groups' hits, but the state
    group's lookup ignores the drop: its hit can then end a block after the attention's K/V (a 576-token hit over
    544 tokens of K/V in ``tests/vllm_adapter/test_hybrid_prefix_caching.py``), and the request would read K/V
    nobody wrote. For a ddtree engine (one state block per request: ``num_speculative_blocks`` 0, where vLLM's own
    speculation keeps one per draft) the lookup stops a block earlier, inside what the attention groups keep.
    Upstream: vllm-project/vllm#48375 and #57128 (open: the state lookup honouring ``drop_eagle_block``). vLLM 0.33's
    coordinator no longer extends the state group's lookup by that block: there this patch is not installed (it
    would cut every hybrid hit by a block), see ``STATE_LOOKUP_FIXED_IN``."""

    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block, *args, **kwargs
    ):
        if drop_eagle_block and getattr(kv_cache_spec, "num_speculative_blocks", None) == 0:
            max_length = max(0, max_length - kv_cache_spec.block_size)
        return original(
            cls,
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            drop_eagle_block,
            *args,
            **kwargs,
        )

    return find_longest_cache_hit


def _lagged_state_frees(original):
    """13a: vLLM frees the state block before the running one as soon as its count passes that block; a ddtree step
    may still write it there (a boundary commit), and under asynchronous scheduling the count runs a step's drafts
    ahead. Holding the count back by the manager's lag keeps the block until its state is written and hashed."""

    def remove_skipped_blocks(self, request_id, num_computed_tokens, *args, **kwargs):
        lag = getattr(self, "_ddtree_free_lag", 0)
        return original(self, request_id, max(0, num_computed_tokens - lag), *args, **kwargs)

    return remove_skipped_blocks


# ---- 2. admission ----------------------------------------------------------------------------------
# True while a ddtree engine's InputProcessor validates a request (2b reads it).
_ADMITTING_FOR_DDTREE = contextvars.ContextVar("ddtree_admitting", default=False)


def _wrap_validate_params(processor_cls) -> None:
    from vllm.sampling_params import SamplingParams

    _wrap_once(processor_cls, "_validate_params", _validate_params_wrapper)
    _wrap_once(SamplingParams, "_validate_spec_decode", _spec_decode_check_for_chains_only)


def _validate_params_wrapper(original):
    def _validate_params(self, params, *args, **kwargs):
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        if ADDITIONAL_CONFIG_KEY not in extra:
            return original(self, params, *args, **kwargs)
        admitting = _ADMITTING_FOR_DDTREE.set(True)
        try:
            # Returned as vLLM returns it (None in 0.25; vLLM 0.33's caller asserts on the value it returns).
            result = original(self, params, *args, **kwargs)
        finally:
            _ADMITTING_FOR_DDTREE.reset(admitting)
        from vllm.sampling_params import SamplingParams

        if isinstance(params, SamplingParams):
            reasons = unsupported_sampling_reasons(params, functools.partial(_structured_outputs_refusal, self))
            if reasons:
                from vllm.exceptions import VLLMValidationError

                # vLLM's own validation error: the API server answers it with a 400 naming the parameter,
                # and logs no traceback (a plain ValueError reaches its catch-all handler, which does).
                raise VLLMValidationError(
                    "This server verifies draft trees (speculative method 'ddtree'), which cannot serve "
                    "requests using: " + "; ".join(reason for _, reason in reasons) + ".",
                    parameter=reasons[0][0],
                )
        return result

    return _validate_params


def _structured_outputs_engine(vllm_config) -> dict:
    """What of an engine's config decides whether it serves structured outputs with trees (patch 12)."""
    structured = getattr(vllm_config, "structured_outputs_config", None)
    return dict(
        world_size=vllm_config.parallel_config.world_size,
        reasoning_parser=getattr(structured, "reasoning_parser", None),
        enable_in_reasoning=bool(getattr(structured, "enable_in_reasoning", False)),
    )


def _structured_outputs_refusal(processor, backend: Optional[str]) -> Optional[str]:
    """Why this engine cannot serve a structured-output request through ``backend`` (None: it can; patch 12)."""
    return structured_outputs_refusal(backend, **_structured_outputs_engine(processor.vllm_config))


def _structured_outputs_start_up_warning(vllm_config) -> Optional[str]:
    backend = getattr(getattr(vllm_config, "structured_outputs_config", None), "backend", "auto")
    return structured_outputs_start_up_warning(backend, **_structured_outputs_engine(vllm_config))


def _spec_decode_check_for_chains_only(original):
    """vLLM refuses ``min_p`` and ``logit_bias`` under any speculative decoding because its rejection
    sampler does not apply them to draft positions. DDTree's sampler applies both at every node
    (``ddtree.vllm.node_sampling``), so a ddtree engine's admission skips that refusal; every other engine
    (and vLLM's chain under ddtree's worker, which never runs) keeps it."""

    def _validate_spec_decode(self, speculative_config, *args, **kwargs):
        if _ADMITTING_FOR_DDTREE.get():
            return None
        return original(self, speculative_config, *args, **kwargs)

    return _validate_spec_decode


# ---- 3. attention backend ------------------------------------------------------------------------
def _register_attention_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "ddtree.vllm.attention.DDTreeAttentionBackend")


# ---- 4. runner class -------------------------------------------------------------------------------
@contextlib.contextmanager
def runner_class_swapped():
    """While active, ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` is DDTree's runner."""
    import vllm.v1.worker.gpu_model_runner as module

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    original = module.GPUModelRunner
    module.GPUModelRunner = DDTreeGPUModelRunner
    try:
        yield
    finally:
        module.GPUModelRunner = original


# ---- 5. hybrid GDN targets: one state slot per request ---------------------------------------------
_SINGLE_SLOT_SHAPES: contextvars.ContextVar[bool] = contextvars.ContextVar("ddtree_single_slot", default=False)


def is_ddtree_config(vllm_config: Any) -> bool:
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra


def _single_slot_spec(original):
    """5a: a ddtree engine's mamba layers hold one state block per request."""

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is not None and is_ddtree_config(vllm_config) and getattr(spec, "num_speculative_blocks", 0):
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    return get_kv_cache_spec


def _single_slot_gdn_init(original):
    """5b: a ddtree engine's GDN layers size their conv state for one slot (W - 1 columns)."""

    def __init__(self, config, vllm_config, *args, **kwargs):
        original(self, config, vllm_config, *args, **kwargs)
        if is_ddtree_config(vllm_config):
            self.num_spec = 0

    return __init__


#: The layer attributes that select a fused GDN spec-decode path that bypasses ``_forward_core`` (5e), each with the
#: value that turns it off. ``test_vllm_plugin`` checks that vLLM's layer sets no other ``enable_fused*spec*`` switch.
FUSED_SPEC_DECODE_SWITCHES = {"enable_fused_gdn_spec_decode": False}


def _no_fused_spec_decode(original):
    """5e: a ddtree engine's Qwen GDN layers verify through ``_forward_core`` (patch 5d), never a fused chain op."""

    def __init__(self, config, vllm_config, *args, **kwargs):
        original(self, config, vllm_config, *args, **kwargs)
        if not is_ddtree_config(vllm_config):
            return
        switched = [name for name, off in FUSED_SPEC_DECODE_SWITCHES.items() if getattr(self, name, off) != off]
        for name in switched:
            setattr(self, name, FUSED_SPEC_DECODE_SWITCHES[name])
        if getattr(self, "gdn_decode_kernel", None) == "cuda":
            self.gdn_decode_kernel = "triton"  # (what vLLM sets where its fused kernel is unsupported)
        if switched:
            from ddtree.vllm.log import get_logger

            get_logger(__name__).info_once(
                "DDTree: GDN layers verify trees with ddtree's kernels; vLLM's fused chain kernel is off"
            )

    return __init__


def _single_slot_alignment(align):
    """5c: while a ddtree engine's page sizes are aligned, GDN state shapes are single-slot."""

    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        token = _SINGLE_SLOT_SHAPES.set(is_ddtree_config(vllm_config))
        try:
            return align(cls, vllm_config, backend_cls)
        finally:
            _SINGLE_SLOT_SHAPES.reset(token)

    return _align_hybrid_block_size


def _single_slot_shape(shape):
    def gated_delta_net_state_shape(cls, *args, **kwargs):
        if _SINGLE_SLOT_SHAPES.get():
            if "num_spec" in kwargs:
                kwargs["num_spec"] = 0
            elif len(args) >= 7:  # tp, Hk, Hv, Dk, Dv, conv width, num_spec
                args = args[:6] + (0,) + args[7:]
        return shape(cls, *args, **kwargs)

    return gated_delta_net_state_shape


def _tree_aware_forward_core(original):
    """5d: tree tokens through DDTree's verification, everything else through vLLM's code."""

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        from ddtree.vllm.context import published

        current = published()
        step = current.gdn if current is not None else None
        if step is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        return _gdn_forward_core_with_trees(self, original, step, mixed_qkv, b, a, core_attn_out)

    return _forward_core


def _gdn_forward_core_with_trees(layer, original, step, mixed_qkv, b, a, core_attn_out) -> None:
    """Tree tokens through DDTree's exact tree verification, the rest through vLLM's own code."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from ddtree.vllm.gdn import verify_tree_tokens

    metadata = get_forward_context().attn_metadata
    md = metadata.get(layer.prefix) if isinstance(metadata, dict) else None
    if md is None or md.spec_sequence_masks is None or md.num_spec_decode_tokens != step.num_tree_tokens:
        raise RuntimeError(
            f"DDTree: GDN layer {layer.prefix} sees {getattr(md, 'num_spec_decode_tokens', None)} spec-decode "
            f"tokens in a step that verifies {step.num_tree_tokens} tree tokens"
        )
    conv_state = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    other = step.other_index

    def verify(rows, out=None):
        return verify_tree_tokens(
            step,
            layer.prefix,
            mixed_qkv[rows],
            a[rows],
            b[rows],
            conv_state,
            layer.kv_cache[1],
            md.spec_state_indices_tensor[:, 0],
            weight,
            layer.conv1d.bias,
            layer.activation,
            layer.A_log,
            layer.dt_bias,
            layer.head_k_dim,
            layer.head_v_dim,
            core_attn_out.dtype,
            out=out,
        )

    if other is None:
        # Every token is a tree token, in batch order (a step of decodes only): the tree rows are the
        # leading rows, read as views and written in place rather than gathered and scattered.
        rows = slice(0, step.num_tree_tokens)
        verify(rows, out=core_attn_out[rows])
        return
    core_attn_out[step.token_index] = verify(step.token_index)
    # vLLM's builder already computed the non-spec half (prefills, and decodes
    # reclassified as prefills) on its own; hide the spec half from its code.
    rest = _without_spec_half(md, int(other.shape[0]))
    out = _zeros_rows(core_attn_out, int(other.shape[0]))
    metadata[layer.prefix] = rest
    try:
        original(layer, mixed_qkv[other], b[other], a[other], out)
    finally:
        metadata[layer.prefix] = md
    core_attn_out[other] = out


#: The spec-decode fields of vLLM's ``GDNAttentionMetadata`` that the non-tree half must not see (0.33 added the
#: last two; a field this vLLM lacks is skipped).
_SPEC_HALF_FIELDS = (
    "spec_query_start_loc",
    "spec_state_indices_tensor",
    "spec_sequence_masks",
    "spec_token_indx",
    "non_spec_token_indx",
    "num_accepted_tokens",
    "spec_sequence_masks_cpu",
    "uniform_spec_sequence_length",
)


def _without_spec_half(md, num_tokens: int):
    """The metadata of a step's non-tree tokens only, for vLLM's own code (prefills, decodes reclassified as
    prefills): no spec-decode requests, tokens, indices or masks."""
    cleared = _spec_half_fields_of(type(md))
    return dataclasses.replace(
        md, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=num_tokens, **dict.fromkeys(cleared)
    )


@functools.lru_cache(maxsize=None)
def _spec_half_fields_of(metadata_class: type) -> Tuple[str, ...]:
    """The spec-decode fields of one GDN metadata class (once per class: the split runs per GDN layer of every mixed
    step)."""
    return tuple(name for name in _SPEC_HALF_FIELDS if name in field_names(metadata_class))


def _zeros_rows(like, rows: int):
    import torch

    return torch.zeros((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)


def _one_kv_group_for_trees(original):
    """11 (config half, vLLM 0.33): a ddtree engine builds a mixed drafter in one KV group (patch 11 under
    ``DDTREE_SLIDING_DRAFTER=1``; refused by ddtree's own check, which names the switch, otherwise)."""

    def _dflash_needs_multi_kv_group(self) -> bool:
        return False if is_ddtree_config(self) else original(self)

    return _dflash_needs_multi_kv_group


def apply_worker_patches(vllm_config: Any) -> None:
    """Patch 11 under ``DDTREE_SLIDING_DRAFTER=1``; patches 5d and 10 in a worker whose target is a hybrid GDN
    model."""
    if sliding_drafter_enabled():
        from vllm.model_executor.models import qwen3_dflash

        _wrap_once(qwen3_dflash, "_resolve_layer_attention", resolve_in_one_kv_group)
    if not getattr(vllm_config.model_config, "is_hybrid", False):
        return
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    _wrap_once(QwenGatedDeltaNetAttention, "_forward_core", _tree_aware_forward_core)
    if whole_tree_gdn_metadata_enabled() and whole_tree_gdn_metadata_matches():
        _wrap_once(GDNAttentionMetadataBuilder, "build", _whole_tree_gdn_build)


#: From this vLLM on, the mamba "align" accounting differs from the one patch 13 and the boundary commits follow
#: (0.33 read: state blocks freed and hashed by processed counts, prefill checkpoint blocks, sub-block hits copied on
#: write; the versions between unread): hybrid prefix caching is refused there until it is derived again.
HYBRID_ALIGN_CHANGED_IN = (0, 26, 0)


def check_hybrid_prefix_caching_served(version: Optional[str] = None) -> None:
    """Refuses ``DDTREE_HYBRID_PREFIX_CACHING`` on a vLLM whose state-block accounting it does not follow (a hashed
    state block could then hold another prefix's state: silently wrong outputs)."""
    version = vllm_version(version)
    if not vllm_below(HYBRID_ALIGN_CHANGED_IN, version):
        raise DDTreeConfigError(
            f"{HYBRID_PREFIX_CACHING_ENV}=1 follows vLLM 0.25's state-block accounting (mamba_cache_mode 'align'); "
            f"vLLM {version} changed it and is not served yet: turn prefix caching off (enable_prefix_caching=False) "
            f"or unset {HYBRID_PREFIX_CACHING_ENV}"
        )


#: Patch 10 writes what vLLM 0.25's GDN builder writes; from this version on (0.33's builder stages other buffers
#: and fills fields 0.25 lacks) vLLM's own build runs. Upstream: a builder that can skip its host classification.
GDN_METADATA_CHANGED_IN = (0, 26, 0)


def whole_tree_gdn_metadata_matches(vllm_version: Optional[str] = None) -> bool:
    """Whether patch 10's metadata is the installed vLLM's (0.25.x; see ``GDN_METADATA_CHANGED_IN``)."""
    return vllm_below(GDN_METADATA_CHANGED_IN, vllm_version)


def _whole_tree_gdn_build(original):
    """10: whole-tree steps' GDN metadata without vLLM's per-group host classification."""
    from ddtree.vllm.gdn_metadata import whole_tree_metadata

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        metadata = whole_tree_metadata(self, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu)
        if metadata is not None:
            return metadata
        return original(
            self, common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, fast_build
        )

    return build


# ---- 6. scheduled-token reservation for drafting -----------------------------------------------
def drafter_depth(vllm_config: Any) -> Optional[int]:
    """L of a ddtree engine: the user's ``num_speculative_tokens``, else the drafter's block_size - 1."""
    settings = vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]
    if settings.get("draft_len") is not None:
        return int(settings["draft_len"])
    draft_model = getattr(vllm_config.speculative_config, "draft_model_config", None)
    block = _drafter_block_size(draft_model.hf_config) if draft_model is not None else None
    return block - 1 if isinstance(block, int) and block >= 2 else None


# (max_num_seqs set by the user, max_num_batched_tokens set by the user) while a ddtree EngineArgs creates
# its VllmConfig; None elsewhere (a VllmConfig built directly, or rebuilt by vLLM: nothing is fitted).
_USER_BATCH_LIMITS: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar(
    "ddtree_user_batch_limits", default=None
)


def _config_error_in(error: BaseException) -> Optional[DDTreeConfigError]:
    """The DDTreeConfigError inside ``error`` (itself, its cause or context, or pydantic's wrapped error)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DDTreeConfigError):
            return error
        details = error.errors() if callable(getattr(error, "errors", None)) else []  # pydantic's
        for detail in details:
            inner = (detail.get("ctx") or {}).get("error") if isinstance(detail, dict) else None
            if isinstance(inner, DDTreeConfigError):
                return inner
        error = error.__cause__ or error.__context__
    return None


def _reservation_by_depth(original):
    def _set_max_num_scheduled_tokens(self):
        spec = self.speculative_config
        depth = drafter_depth(self) if spec is not None and is_ddtree_config(self) else None
        if depth is None:  # not ddtree, or no depth to go by (validate_vllm_config then names the problem)
            return original(self)
        budget = spec.num_speculative_tokens
        spec.num_speculative_tokens = depth
        try:
            _fit_batch_limits(self, budget, spec.max_num_new_slots_for_drafting)
            return original(self)
        finally:
            spec.num_speculative_tokens = budget

    return _set_max_num_scheduled_tokens


def _fit_batch_limits(vllm_config: Any, budget: int, reserve_per_request: int) -> None:
    """7: vLLM's default batch limits fitted to whole trees (see ``config.fit_batch_limits``)."""
    user = _USER_BATCH_LIMITS.get()
    scheduler = vllm_config.scheduler_config
    if user is None or scheduler.max_num_scheduled_tokens is not None:
        return
    limits = fit_batch_limits(
        budget=budget,
        reserve_per_request=reserve_per_request,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        seqs_from_user=user[0],
        tokens_from_user=user[1],
    )
    if limits.reason is None:
        return
    old_tokens = scheduler.max_num_batched_tokens
    scheduler.max_num_seqs = limits.max_num_seqs
    scheduler.max_num_batched_tokens = limits.max_num_batched_tokens
    for derived in ("max_num_encoder_input_tokens", "encoder_cache_size"):  # SchedulerConfig copies these
        if getattr(scheduler, derived, None) == old_tokens:
            setattr(scheduler, derived, limits.max_num_batched_tokens)
    _log().info("DDTree: %s", limits.reason)


def _tree_capture_sizes(original):
    """8: CUDA-graph sizes that hold whole trees, when the user chose none."""

    def _set_cudagraph_sizes(self):
        compilation = self.compilation_config
        mode = getattr(compilation.cudagraph_mode, "name", compilation.cudagraph_mode)
        if (
            is_ddtree_config(self)
            and self.speculative_config is not None
            and compilation.cudagraph_capture_sizes is None
            and compilation.max_cudagraph_capture_size is None
            and self.model_config is not None
            and not self.model_config.enforce_eager
            and mode not in (None, "NONE")
        ):
            scheduler = self.scheduler_config
            sizes = tree_capture_sizes(
                self.speculative_config.num_speculative_tokens, scheduler.max_num_seqs, scheduler.max_num_batched_tokens
            )
            compilation.cudagraph_capture_sizes = sizes
            compilation.max_cudagraph_capture_size = sizes[-1]
            _log().info(
                "DDTree: %d CUDA-graph sizes up to %d tokens (whole trees of %d tokens)",
                len(sizes),
                sizes[-1],
                self.speculative_config.num_speculative_tokens + 1,
            )
        return original(self)

    return _set_cudagraph_sizes


# ---- 9. spec-decode metrics read as trees ----------------------------------------------------------------
def tree_shape(vllm_config: Any) -> tuple:
    """(budgets, drafter depth L) of a ddtree engine: its budget ``B``, or a budget schedule's budgets (the
    largest is ``B``); L falls back to B when it cannot be told."""
    budget = int(vllm_config.speculative_config.num_speculative_tokens)
    settings = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY) or {}
    budgets = budget
    if isinstance(settings, dict) and settings:
        cfg = DDTreeConfig.from_dict({"draft_len": None, "top_k": None, **settings, "budget": budget})
        budgets = cfg.budgets if cfg.varies_by_batch_size else budget
    return budgets, drafter_depth(vllm_config) or budget


def _tree_metrics_prom(original):
    """9: a ddtree engine's Prometheus logger builds DDTree's subclass of its own spec-decoding class."""

    def __init__(self, vllm_config, *args, **kwargs):
        from vllm.v1.spec_decode.metrics import SpecDecodingProm

        base = type(self)._spec_decoding_cls
        if (
            is_ddtree_config(vllm_config)
            and vllm_config.speculative_config is not None
            and isinstance(base, type)
            and issubclass(base, SpecDecodingProm)
        ):
            from ddtree.vllm.metrics import spec_decoding_prom_factory

            self._spec_decoding_cls = spec_decoding_prom_factory(base, type(self)._gauge_cls, *tree_shape(vllm_config))
        return original(self, vllm_config, *args, **kwargs)

    return __init__


def _tree_metrics_log(original):
    """9: a ddtree engine's periodic log line reads its spec-decode stats as trees."""

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm.v1.spec_decode.metrics import SpecDecodingLogging

        current = getattr(self, "spec_decoding_logging", None)
        if (
            is_ddtree_config(vllm_config)
            and vllm_config.speculative_config is not None
            and type(current) is SpecDecodingLogging
            and not current.is_diffusion
        ):
            from ddtree.vllm.metrics import DDTreeSpecDecodingLogging

            self.spec_decoding_logging = DDTreeSpecDecodingLogging(*tree_shape(vllm_config))

    return __init__


# ---- 12. structured outputs over trees -------------------------------------------------------------------
def _tree_grammar_bitmask(original):
    """12a: a ddtree engine's grammar rows follow the trees: for each structured request verifying a tree, node
    ``j``'s row is the mask after the committed text and the tokens on its root path (``grammar.fill_step_bitmask``),
    where vLLM's rows read the draft slots as a chain. vLLM's own call, on a copy of the step without its draft
    slots, gives each request's row as vLLM decides it (terminated grammars, the rows of requests without drafts)
    and allocates its bitmask buffer, which the tree rows then fill (it holds ``1 + num_speculative_tokens`` rows a
    request: ``1 + budget``). On vLLM 0.33 (a ``num_acceptable_drafts`` field) each request's rows start a block of
    that many rows, and the count of rows a block constrains is the request's slots: 0.33 would otherwise strip the
    ``-1`` placeholders a tree's slots are to none. Upstream: a hook for a tree's rows (vLLM lays them out as a
    chain)."""

    def get_grammar_bitmask(self, scheduler_output):
        # (vLLM asks every step: a step without a structured request costs one attribute read more than vLLM's.)
        if not scheduler_output.has_structured_output_requests or not is_ddtree_config(self.vllm_config):
            return original(self, scheduler_output)
        from ddtree.vllm import grammar

        started = time.perf_counter()
        trees = grammar.trees_for(scheduler_output)
        slots = scheduler_output.scheduled_spec_decode_tokens
        without_drafts = copy.copy(scheduler_output)
        without_drafts.scheduled_spec_decode_tokens = {}
        output = original(self, without_drafts)
        if output is None:
            return None
        request_ids = output.structured_output_request_ids
        num_drafts = [len(slots.get(req_id, ())) for req_id in request_ids]
        if not any(num_drafts):
            return output
        # vLLM 0.33 gives each request a block of 1 + num_speculative_tokens rows and says how many drafts each
        # block's rows constrain (for the tree rows: all its slots); vLLM 0.25 packs the rows.
        stride = len(output.grammar_bitmask) // len(request_ids) if hasattr(output, "num_acceptable_drafts") else None
        # vLLM's own row of each request (a copy: they are views of the buffer the tree rows overwrite).
        own_rows = output.grammar_bitmask[:: stride or 1].copy()
        buffer = self.structured_output_manager._grammar_bitmask
        needed = len(request_ids) + sum(num_drafts)
        if buffer.shape[0] < needed:
            raise RuntimeError(f"DDTree: {needed} grammar rows for a bitmask of {buffer.shape[0]} (a bug)")

        def matcher_of(req_id):
            matcher = getattr(self.requests[req_id].structured_output_request.grammar, "matcher", None)
            if matcher is None or not hasattr(matcher, "traverse_draft_tree"):
                raise RuntimeError(f"DDTree: request {req_id!r}'s grammar is not xgrammar's (refused at admission)")
            return matcher

        rows = grammar.fill_step_bitmask(buffer, request_ids, num_drafts, own_rows, matcher_of, trees, stride)
        grammar.STATS.seconds += time.perf_counter() - started
        output = dataclasses.replace(output, grammar_bitmask=buffer[:rows].numpy())
        return output if stride is None else dataclasses.replace(output, num_acceptable_drafts=num_drafts)

    return get_grammar_bitmask


@contextlib.contextmanager
def _grammar_checks_off(scheduler):
    """While vLLM's scheduler takes a ddtree engine's drafts, its manager reports no request as advancing its grammar,
    which is the only thing it asks it there: the draft slots are placeholders for the next trees (late trees) or a
    tree's nodes in pop order, not a chain to cut at the first token the grammar refuses (that would leave a
    structured request no tree). The masks check every node instead (12a). Admission refuses reasoning parsers,
    the only case in which the check has a side effect (it notes the end of the reasoning). vLLM 0.33 asks its
    manager's ``validate_tokens`` instead, which then returns the drafts as they are."""
    manager = scheduler.structured_output_manager
    overrides = {"should_advance": lambda request: False}
    if hasattr(manager, "validate_tokens"):  # vLLM 0.33
        overrides["validate_tokens"] = lambda request, spec_tokens: spec_tokens
    vars(manager).update(overrides)
    try:
        yield
    finally:
        for name in overrides:
            del vars(manager)[name]


def _tree_drafts_unchecked(original):
    """12b: synchronous scheduling: a ddtree engine's drafts are scheduled as they are (see ``_grammar_checks_off``)."""

    def update_draft_token_ids(self, draft_token_ids):
        # (vLLM makes its grammar backend at the first structured request: until then there is nothing to check.)
        if self.structured_output_manager.backend is None or not is_ddtree_config(self.vllm_config):
            return original(self, draft_token_ids)
        with _grammar_checks_off(self):
            return original(self, draft_token_ids)

    return update_draft_token_ids


def _tree_placeholders_kept(original):
    """12c: asynchronous scheduling, a step whose sampling waits for the last step's output (a structured request
    decoding): vLLM replaces the step's placeholder drafts by the drafter's chain, cut where the grammar refuses it
    and padded with placeholders, before computing the masks. A ddtree step's placeholders are its trees' slots,
    filled with the trees' nodes on the GPU already: they stay, and nothing is counted invalid (12a masks the
    nodes)."""

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
        if not is_ddtree_config(self.vllm_config):
            return original(self, draft_token_ids, scheduler_output)
        return None

    return update_draft_token_ids_in_output


def apply() -> None:
    """Applies patches 1-3 (1c included), 5a-c, 5e, 6-9, 11's config half, 12 and 13 (4, 5d, 10 and 11 are
    applied by the worker). Raises
    on unsupported vLLM."""
    global _APPLIED
    import vllm

    check_version(vllm.__version__)
    if _APPLIED:
        return
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.platforms.interface import Platform
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    _wrap_create_engine_config(EngineArgs)
    _wrap_validate_params(InputProcessor)
    _register_attention_backend()
    _wrap_once(MambaBase, "get_kv_cache_spec", _single_slot_spec)
    _wrap_once(GatedDeltaNetAttention, "__init__", _single_slot_gdn_init)
    _wrap_once(QwenGatedDeltaNetAttention, "__init__", _no_fused_spec_decode)
    _wrap_once(Platform, "_align_hybrid_block_size", _single_slot_alignment)
    _wrap_once(MambaStateShapeCalculator, "gated_delta_net_state_shape", _single_slot_shape)
    _wrap_once(VllmConfig, "_set_max_num_scheduled_tokens", _reservation_by_depth)
    _wrap_once(VllmConfig, "_set_cudagraph_sizes", _tree_capture_sizes)
    if hasattr(VllmConfig, "_dflash_needs_multi_kv_group"):  # (vLLM 0.33's V1 refusal of mixed drafters)
        _wrap_once(VllmConfig, "_dflash_needs_multi_kv_group", _one_kv_group_for_trees)
    _wrap_once(VllmConfig, "_maybe_override_dynamic_sd_cudagraph_mode", _keep_full_graphs_under_a_schedule)
    _wrap_once(Scheduler, "__init__", _scheduler_set_up_for_trees)
    _wrap_once(Scheduler, "get_grammar_bitmask", _tree_grammar_bitmask)
    _wrap_once(Scheduler, "update_draft_token_ids", _tree_drafts_unchecked)
    _wrap_once(Scheduler, "update_draft_token_ids_in_output", _tree_placeholders_kept)
    install_state_block_patches()
    _wrap_once(PrometheusStatLogger, "__init__", _tree_metrics_prom)
    _wrap_once(LoggingStatLogger, "__init__", _tree_metrics_log)
    _APPLIED = True
