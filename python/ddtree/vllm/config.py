"""DDTree's user-facing vLLM configuration: parsing, translation, validation.

Pure Python (no vLLM import), so CI tests it without vLLM installed.

The user writes::

    --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>",
                           "num_speculative_tokens": 15, "ddtree_budget": 64}'

vLLM 0.25.1 has no way to register a speculative method and its
``SpeculativeConfig`` forbids unknown keys, so :func:`translate` rewrites the
request before vLLM sees it:

* ``method`` becomes ``"dflash"`` (the drafter *is* a DFlash drafter; vLLM
  loads it, we only change what is done with its output);
* vLLM's ``num_speculative_tokens`` becomes the tree budget B: the scheduler
  sees B draft tokens per request (the tree's nodes in pop order, parents
  first), reserves B+1 query slots and KV slots, and verifies B+1 logits rows;
* the drafter's depth L (the user's ``num_speculative_tokens``, = DFlash block
  size - 1) and the other ``ddtree_*`` keys move to
  ``additional_config["ddtree"]``, which vLLM ships to every process with the
  rest of ``VllmConfig``.

Restrictions of this adapter (each checked, each refused with the
reason when the user asked for the opposite, see :data:`ENGINE_OVERRIDES`):
CUDA graphs as :func:`cudagraph_mode_choice` allows, V1 model runner, asynchronous scheduling as
:func:`async_scheduling_choice` decides, the adapter's own attention backend for the target
(CUSTOM) and its own worker class, attention-only or Gated-DeltaNet hybrid targets
(:data:`GDN_ARCHITECTURES`) without sliding windows, unquantized KV cache,
tensor parallelism only (pipeline/data parallel size 1). Prefix caching follows vLLM's default (on for
attention-only targets, off for hybrids) and is refused for hybrids and beside a KV connector.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddtree.errors import DDTreeError
from ddtree.vllm.auto_budget import AUTO, DEFAULT_MAX_BUDGET, auto_candidates, block_budgets

METHOD = "ddtree"
ADDITIONAL_CONFIG_KEY = "ddtree"
WORKER_CLS = "ddtree.vllm.worker.DDTreeWorker"
ATTENTION_BACKEND = "CUSTOM"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: vLLM's breakable CUDA graphs (attention and the GDN core as eager pieces inside one captured graph; vLLM turns
#: them on for some architectures, and on 0.33 under VLLM_BATCH_INVARIANT=1, when this is unset): ddtree's graph
#: bookkeeping (capture sizes, the commit inputs a FULL capture records) follows torch.compile's piecewise graphs.
BREAKABLE_GRAPHS_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
#: "0" commits the GDN state of FULL tree steps layer by layer instead of through one CUDA graph per FULL size.
COMMIT_GRAPHS_ENV = "DDTREE_COMMIT_GRAPHS"
#: "1" (the default) lets a commit graph read a replayed walk's paths where the walk graph left them; "0" copies them.
COMMIT_IN_PLACE_ENV = "DDTREE_COMMIT_IN_PLACE"
#: "1" (the default) leaves prefix caching as vLLM decides it (its default, or the user's choice); "0" turns it off.
PREFIX_CACHING_ENV = "DDTREE_PREFIX_CACHING"
WHOLE_TREE_GDN_METADATA_ENV = "DDTREE_WHOLE_TREE_GDN_METADATA"
DEVICE_ACCEPT_ENV = "DDTREE_DEVICE_ACCEPT"
LATE_TREES_ENV = "DDTREE_LATE_TREES"
ASYNC_SCHEDULING_ENV = "DDTREE_ASYNC_SCHEDULING"
STEP_GRAPHS_ENV = "DDTREE_STEP_GRAPHS"
#: "1" (the default) captures the placement and walk graphs of every FULL size at start-up; "0" at their first step;
#: "all" (experimental) the commit's (GDN commit, K/V moves) too.
PRECAPTURE_ENV = "DDTREE_PRECAPTURE"
PRECAPTURE_MODES = ("1", "0", "all")
LAUNCH_AHEAD_ENV = "DDTREE_LAUNCH_AHEAD"
#: "1" replays the drafter's top-K (logits, top-K, packing) as one CUDA graph per batch size (experimental, off).
TOPK_GRAPHS_ENV = "DDTREE_TOPK_GRAPHS"
#: "auto" (default) / "1" build and lay out a steady whole-tree step's trees on the device; "0" on the host.
DEVICE_PLAN_ENV = "DDTREE_DEVICE_PLAN"
#: "1" (the default) plans on the device too the steps of some of the last proposal's requests, in any order
#: (requests finished or reordered since it: a gather of their top-K rows); "0" plans those on the host.
DEVICE_PLAN_SUBSETS_ENV = "DDTREE_DEVICE_PLAN_SUBSETS"
#: "1" replays the device walk (and its K/V moves) of a step with a prefill beside whole trees as a CUDA graph too
#: (experimental, off until a GPU run); "0" walks such steps op by op.
MIXED_WALK_GRAPHS_ENV = "DDTREE_MIXED_WALK_GRAPHS"
#: "1" runs a drafter that mixes sliding-window and full-attention layers (experimental, off: refused).
SLIDING_DRAFTER_ENV = "DDTREE_SLIDING_DRAFTER"
#: "1" serves structured outputs (xgrammar) with per-node grammar masks (experimental, off: refused at admission).
STRUCTURED_OUTPUTS_ENV = "DDTREE_STRUCTURED_OUTPUTS"
#: "1" caches prefixes of hybrid targets (vLLM's mamba cache mode "align", with boundary commits; experimental, off:
#: prefix caching refused for hybrids).
HYBRID_PREFIX_CACHING_ENV = "DDTREE_HYBRID_PREFIX_CACHING"

#: Largest budget accepted. Each request verifies B+1 tokens and computes B+1
#: rows of full-vocabulary logits per step; beyond this the logits alone
#: dominate memory for real vocabularies.
MAX_BUDGET = 1024
#: DFlash drafters in the wild use blocks of 8 or 16; anything deeper than this
#: is almost certainly a typo.
MAX_DRAFT_LEN = 64

#: ``ddtree_*`` keys of the speculative config and their meaning.
DDTREE_KEYS = {
    "ddtree_budget": "tree budget B: draft nodes verified per request and step (required); a schedule by batch size; "
    "or \"auto\"",
    "ddtree_max_budget": f"with ddtree_budget \"auto\": the largest candidate budget (default {DEFAULT_MAX_BUDGET})",
    "ddtree_top_k": "candidates kept per drafter position (default min(B, vocab size))",
    "ddtree_num_threads": "threads of the Rust tree builder (default 1)",
}

#: Speculative-config keys that make no sense with a tree (vLLM keys).
_REFUSED_SPEC_KEYS = {
    "disable_padded_drafter_batch": "the adapter relies on vLLM's padded drafter batch",
    "num_speculative_tokens_per_batch_size": "dynamic speculative decoding is not supported with trees",
    "rejection_sample_method": "tree acceptance replaces vLLM's rejection sampler",
    "synthetic_acceptance_rates": "tree acceptance replaces vLLM's rejection sampler",
    "synthetic_acceptance_length": "tree acceptance replaces vLLM's rejection sampler",
    "draft_sample_method": "the tree is built from the drafter's top-K, never sampled",
    "use_heterogeneous_vocab": "the drafter must share the target's vocabulary",
    "use_local_argmax_reduction": "the tree needs the drafter's top-K, not its argmax",
    "parallel_drafting": "set by vLLM for DFlash drafters",
}


class DDTreeConfigError(DDTreeError, ValueError):
    """An invalid ``method: "ddtree"`` configuration; the message says why."""


#: ``((smallest batch size, budget), ...)``, ascending by batch size and starting at 1.
BudgetSchedule = Tuple[Tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class DDTreeConfig:
    budget: int  # the largest budget: it sizes vLLM's draft slots, the tree buffers and the FULL graphs
    draft_len: Optional[int]  # L; None until resolved from the drafter's block_size
    top_k: Optional[int]  # None: min(budget, vocab), resolved against the vocab
    num_threads: int = 1
    budget_schedule: Optional[BudgetSchedule] = None  # None: ``budget`` at every batch size
    auto: bool = False  # ``ddtree_budget: "auto"``: ``budget`` is the largest candidate (``ddtree.vllm.auto_budget``)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DDTreeConfig":
        fields = {f.name: data.get(f.name) for f in dataclasses.fields(cls) if f.name in data}
        if fields.get("budget_schedule") is not None:  # lists after a JSON round trip
            fields["budget_schedule"] = tuple((int(size), int(budget)) for size, budget in fields["budget_schedule"])
        return cls(**fields)

    def budget_for(self, num_requests: int) -> int:
        """The tree budget of a step in which ``num_requests`` requests draft: the schedule's entry for the
        largest batch size that is at most ``num_requests`` (``auto``: the largest candidate; the runner's
        ``AutoBudget`` decides live)."""
        if not self.budget_schedule:
            return self.budget
        chosen = self.budget_schedule[0][1]
        for size, budget in self.budget_schedule:
            if size > num_requests:
                break
            chosen = budget
        return chosen

    @property
    def budgets(self) -> Tuple[int, ...]:
        """Every budget a step can use, ascending (``auto``: its candidates)."""
        if self.auto:
            return auto_candidates(self.draft_len, self.budget)
        return schedule_budgets(self.budget, self.budget_schedule)

    @property
    def varies_by_batch_size(self) -> bool:
        """Whether steps may use budgets below the largest (a schedule, or ``auto``)."""
        return len(self.budgets) > 1

    def width(self, vocab_size: int) -> int:
        """K, the drafter candidates per position."""
        k = self.top_k if self.top_k is not None else self.budget
        return max(1, min(k, self.budget, vocab_size))

    def budgets_unfilled(self, top_k: Optional[int] = None) -> List[int]:
        """The budgets whose trees hold fewer nodes than the budget with ``top_k`` candidates per position (default:
        the user's ``ddtree_top_k``) at the drafter's depth; empty when they all fill it or when that is not known
        yet (no top-K: K is then the budget, which always fills; or no depth yet)."""
        top_k = self.top_k if top_k is None else top_k
        if top_k is None or self.draft_len is None:
            return []
        return [b for b in self.budgets if tree_size(b, min(top_k, b), self.draft_len) < b]


@functools.lru_cache(maxsize=None)
def field_names(dataclass_type: type) -> frozenset:
    """A dataclass's field names, once per class (vLLM's metadata classes gain fields between versions; the adapter
    asks which this vLLM has on paths that run every step)."""
    return frozenset(field.name for field in dataclasses.fields(dataclass_type))


def check_long_prefill_threshold(threshold: int, budget: int) -> None:
    """Refuses a ``long_prefill_token_threshold`` that cannot hold a whole tree (``budget + 1`` tokens): vLLM cuts
    every request's scheduled tokens to it, so every tree would be cut, and it cuts a first decode it padded with
    ``budget`` placeholders to fewer tokens than its drafts (inconsistent in vLLM's own bookkeeping: no tree can
    verify it)."""
    if 0 < threshold <= budget:
        raise DDTreeConfigError(
            f"method 'ddtree' needs long_prefill_token_threshold above the budget (a tree of {budget + 1} tokens "
            f"per request and step); got {threshold}: set it to at least {budget + 1}, or to 0 (none)"
        )


def tree_size(budget: int, top_k: int, draft_len: int) -> int:
    """Draft nodes of the tree the Rust builder returns for ``budget``: the ``budget`` most probable prefixes, or
    every prefix there is (``top_k`` choices at each of ``draft_len`` depths) when there are fewer."""
    total, level = 0, 1
    for _ in range(draft_len):
        level *= top_k
        total += level
        if total >= budget:
            return budget
    return total


def smaller_budgets(cfg: "DDTreeConfig") -> Tuple[int, ...]:
    """The budgets below an engine's largest whose acceptance its statistics estimate from the trees it verifies
    (``DDTreeStats``): budgets ``2^k - 1`` from 7 (the recommended sizes: ``auto_budget.auto_candidates``) and the
    schedule's budgets, ascending."""
    ladder = set(block_budgets(7, MAX_BUDGET)) | set(cfg.budgets)
    return tuple(sorted(b for b in ladder if b < cfg.budget))


def schedule_budgets(budget: int, schedule: Optional[Sequence[Sequence[int]]]) -> Tuple[int, ...]:
    """Every budget of an engine whose largest is ``budget``, ascending (a schedule's, or ``budget`` alone)."""
    return tuple(sorted({int(b) for _, b in schedule or ()} | {budget}))


def _positive_int(name: str, value: Any, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DDTreeConfigError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise DDTreeConfigError(f"{name} must be a positive integer, got {value}")
    if maximum is not None and value > maximum:
        raise DDTreeConfigError(f"{name} must be at most {maximum}, got {value}")
    return value


def parse_budget(value: Any) -> Tuple[int, Optional[BudgetSchedule]]:
    """``ddtree_budget``: a budget, or a schedule ``{"<batch size>": budget, ...}`` (from batch size 1 on; a step
    of ``n`` drafting requests takes the entry of the largest batch size <= ``n``). Returns the largest budget and
    the schedule (None when one budget serves every batch size). ``"auto"`` is read by :func:`parse_spec_config`."""
    if isinstance(value, str):
        raise DDTreeConfigError(
            f"ddtree_budget must be a positive integer, a schedule like {{\"1\": 64, \"8\": 16}}, or \"auto\"; "
            f"got {value!r}"
        )
    if not isinstance(value, Mapping):
        return _positive_int("ddtree_budget", value, MAX_BUDGET), None
    if not value:
        raise DDTreeConfigError("ddtree_budget as a schedule needs at least one entry, like {\"1\": 64}")
    schedule: Dict[int, int] = {}
    for key, budget in value.items():
        size = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        size = _positive_int(f"ddtree_budget's batch size {key!r}", size)
        if size in schedule:
            raise DDTreeConfigError(f"ddtree_budget names batch size {size} twice")
        schedule[size] = _positive_int(f"ddtree_budget[{key!r}]", budget, MAX_BUDGET)
    if 1 not in schedule:
        raise DDTreeConfigError(
            f"ddtree_budget's schedule must start at batch size 1 (got batch sizes {sorted(schedule)}), "
            "so that every step has a budget"
        )
    entries = tuple(sorted(schedule.items()))
    largest = max(schedule.values())
    if all(budget == largest for _, budget in entries):
        return largest, None
    return largest, entries


def budget_description(cfg: DDTreeConfig) -> str:
    """``64``, or a schedule as ``64 from 1, 32 from 8, 16 from 32 requests``."""
    if cfg.auto:
        return f"auto (candidates {', '.join(str(b) for b in cfg.budgets)})"
    if not cfg.budget_schedule:
        return str(cfg.budget)
    return ", ".join(f"{b} from {n}" for n, b in cfg.budget_schedule) + " requests"


#: Rows per block of the tree GDN and attention kernels: a tree (its nodes and root) pays by whole blocks.
KERNEL_ROW_BLOCK = 16


def lone_row_budgets(cfg: DDTreeConfig) -> Tuple[int, ...]:
    """The fixed budgets whose trees (nodes and root) open a kernel row block for one row (``b + 1 = 16k + 1``):
    one node fewer verifies faster at nearly the same acceptance. ``auto`` picks its own candidates."""
    if cfg.auto:
        return ()
    return tuple(b for b in cfg.budgets if b >= KERNEL_ROW_BLOCK and b % KERNEL_ROW_BLOCK == 0)


def lone_row_advice(cfg: DDTreeConfig) -> Optional[str]:
    """A start-up hint for :func:`lone_row_budgets` (None when there is none)."""
    lone = lone_row_budgets(cfg)
    if not lone:
        return None
    better = ", ".join(f"{b - 1} for {b}" for b in lone)
    return (
        f"budget(s) {', '.join(map(str, lone))} verify one token past a multiple of {KERNEL_ROW_BLOCK} per tree (with "
        f"the root); the tree kernels pay by blocks of {KERNEL_ROW_BLOCK} rows, so {better} verifies faster for one "
        "node's acceptance (the tree GDN kernel ~20% at the Qwen3.6-27B shape: docs/performance.md)"
    )


#: Tokens a step of whole trees reaches at full concurrency from which, on a large target, a fixed budget's step is
#: bound by the target's arithmetic: at the Qwen3.6-27B shape 8 trees of 65 tokens (520) cost 2.47x the chain's step
#: (``gpu-h200-async-b798afe``), 8 trees of 16 (128) 0.90x (``gpu-h200-27b-94baa94``).
ARITHMETIC_BOUND_STEP_TOKENS = 512
#: The hidden size from which a target counts as large for that advice: a heuristic, measured at one shape only
#: (Qwen3.6-27B: 5120; the test pair, 256, runs host-bound steps at any batch its bench runs).
LARGE_TARGET_HIDDEN_SIZE = 2048


def large_batch_advice(cfg: DDTreeConfig, max_num_seqs: int, hidden_size: int) -> Optional[str]:
    """A start-up hint for a fixed budget on a large target served to many requests at once, whose steps of whole
    trees would be bound by the target's arithmetic (None when there is none: a schedule or ``auto`` picks budgets
    by batch size, a small target's steps are host work, few requests make small steps)."""
    if cfg.auto or cfg.budget_schedule or hidden_size < LARGE_TARGET_HIDDEN_SIZE:
        return None
    tokens = max_num_seqs * (cfg.budget + 1)
    small, many = max(15, cfg.draft_len or 0), min(8, max_num_seqs)
    if tokens < ARITHMETIC_BOUND_STEP_TOKENS or cfg.budget <= small or many < 2:
        return None  # (small steps; a budget no larger than the one advised; one request: nothing to schedule)
    return (
        f"a fixed budget of {cfg.budget} verifies up to {max_num_seqs} x {cfg.budget + 1} = {tokens} tokens a step; on "
        f"a target this large (hidden size {hidden_size}) such steps cost the target's arithmetic, more than the trees "
        f"gain (at the Qwen3.6-27B shape budget 64 costs 2.47x the DFlash chain's step at batch 8, budget 15 0.90x): a "
        f'schedule such as {{"1": {cfg.budget}, "{many}": {small}}}, or "auto", keeps large batches fast '
        "(docs/vllm-adapter.md, choosing a budget)"
    )


def parse_spec_config(spec: Mapping[str, Any]) -> Tuple[Dict[str, Any], DDTreeConfig]:
    """Splits a ``method: "ddtree"`` speculative config.

    Returns the speculative config vLLM will see (``method: "dflash"``,
    ``num_speculative_tokens`` = budget) and the DDTree settings.
    """
    if spec.get("method") != METHOD:
        raise DDTreeConfigError(f"not a ddtree speculative config: method={spec.get('method')!r}")
    unknown = [k for k in spec if k.startswith("ddtree_") and k not in DDTREE_KEYS]
    if unknown:
        known = ", ".join(sorted(DDTREE_KEYS))
        raise DDTreeConfigError(f"unknown ddtree option(s) {sorted(unknown)}; known: {known}")
    refused = {k: why for k, why in _REFUSED_SPEC_KEYS.items() if k in spec}
    if refused:
        reasons = "; ".join(f"{k}: {why}" for k, why in refused.items())
        raise DDTreeConfigError(f"speculative-config key(s) not supported with method 'ddtree' ({reasons})")
    if not spec.get("model"):
        raise DDTreeConfigError(
            "method 'ddtree' needs a DFlash drafter: set speculative_config['model'] to its path or HF id"
        )
    if "ddtree_budget" not in spec:
        raise DDTreeConfigError("method 'ddtree' needs ddtree_budget (the number of tree nodes verified per step)")
    auto = spec["ddtree_budget"] == AUTO
    if "ddtree_max_budget" in spec and not auto:
        raise DDTreeConfigError(
            f"ddtree_max_budget goes with ddtree_budget \"auto\" (got ddtree_budget={spec['ddtree_budget']!r}); "
            "drop it or ask for \"auto\""
        )
    if auto:
        budget, schedule = (
            _positive_int("ddtree_max_budget", spec.get("ddtree_max_budget", DEFAULT_MAX_BUDGET), MAX_BUDGET),
            None,
        )
    else:
        budget, schedule = parse_budget(spec["ddtree_budget"])
    # auto's candidates start at the drafter's depth: only its largest must reach it.
    smallest = budget if auto else schedule_budgets(budget, schedule)[0]
    draft_len = spec.get("num_speculative_tokens")
    if draft_len is not None:
        draft_len = _positive_int(
            "num_speculative_tokens (the drafter's depth L = DFlash block_size - 1)", draft_len, MAX_DRAFT_LEN
        )
        if smallest < draft_len:
            raise DDTreeConfigError(
                f"{'ddtree_max_budget' if auto else 'ddtree_budget'}={smallest} is smaller than the drafter's depth "
                f"num_speculative_tokens={draft_len}; "
                "this adapter sizes the drafter's buffers by the budget, so it needs budget >= depth"
            )
    top_k = spec.get("ddtree_top_k")
    if top_k is not None:
        top_k = _positive_int("ddtree_top_k", top_k)
    num_threads = _positive_int("ddtree_num_threads", spec.get("ddtree_num_threads", 1), 256)
    vllm_spec = {k: v for k, v in spec.items() if not k.startswith("ddtree_")}
    vllm_spec["method"] = "dflash"
    vllm_spec["num_speculative_tokens"] = budget
    cfg = DDTreeConfig(
        budget=budget, draft_len=draft_len, top_k=top_k, num_threads=num_threads, budget_schedule=schedule, auto=auto
    )
    return vllm_spec, cfg


#: Engine settings the adapter needs: (EngineArgs attribute, required value,
#: values that count as "not set by the user", why).
ENGINE_OVERRIDES = (
    (
        "async_scheduling",
        None,  # decided by async_scheduling_choice
        (None,),
        "vLLM's asynchronous scheduling with one GPU, synchronous under tensor parallelism or where the trees "
        "cannot fill every budget (DDTREE_ASYNC_SCHEDULING; docs/async-scheduling.md)",
    ),
    (
        "enable_prefix_caching",
        None,  # decided by prefix_caching_choice
        (None,),
        f"prefix caching at vLLM's default (on for attention-only targets) unless {PREFIX_CACHING_ENV}=0; off "
        "beside a KV connector, which may read a block before a tree step's K/V moves reach it "
        "(docs/prefix-caching.md)",
    ),
    ("attention_backend", ATTENTION_BACKEND, (None,), "the target's attention must run DDTree's tree backend"),
    ("worker_cls", WORKER_CLS, ("auto",), "DDTree's worker installs its model runner"),
)


def override_reason(
    attr: str,
    environ: Mapping[str, str] = os.environ,
    tensor_parallel_size: int = 1,
    cfg: Optional["DDTreeConfig"] = None,
) -> str:
    """Why the adapter sets ``attr`` (one of :data:`ENGINE_OVERRIDES`), for the start-up log; for
    ``async_scheduling`` turned off, also what made it synchronous."""
    why = next(why for name, _, _, why in ENGINE_OVERRIDES if name == attr)
    if attr != "async_scheduling":
        return why
    switch, lacking = _async_scheduling_state(environ, tensor_parallel_size, cfg)
    if not switch:
        by_hand = environ.get(ASYNC_SCHEDULING_ENV)
        cause = (
            f"{ASYNC_SCHEDULING_ENV}={by_hand}"
            if by_hand is not None
            else f"tensor_parallel_size={tensor_parallel_size}"
        )
        return f"{why}; synchronous here: {cause}"
    return f"{why}; synchronous here: it needs {'; '.join(lacking)}" if lacking else why


#: Parallelism the adapter refuses (EngineArgs attribute -> why).
_PARALLEL_LIMITS = {
    "pipeline_parallel_size": "the drafter and acceptance assume one stage",
    "data_parallel_size": "not validated",
}


def engine_overrides(
    args: Any, environ: Mapping[str, str] = os.environ, cfg: Optional["DDTreeConfig"] = None
) -> Dict[str, Any]:
    """The EngineArgs attributes to set; raises when the user asked for the opposite.

    ``args`` is an ``EngineArgs`` (or anything with the same attributes); ``cfg`` the engine's DDTree settings (whether
    its trees fill every budget decides asynchronous scheduling's default).
    """
    changes: Dict[str, Any] = {}
    for attr, required, unset, why in ENGINE_OVERRIDES:
        if not hasattr(args, attr):
            continue
        if attr == "async_scheduling":
            tensor_parallel_size = getattr(args, "tensor_parallel_size", 1) or 1
            choice = async_scheduling_choice(args.async_scheduling, environ, tensor_parallel_size, cfg)
            if choice is not None:
                changes[attr] = choice
            continue
        if attr == "enable_prefix_caching":
            choice = prefix_caching_choice(args.enable_prefix_caching, environ, _has_kv_connector(args))
            if choice is not None:
                changes[attr] = choice
            continue
        value = getattr(args, attr)
        if attr == "attention_backend" and value is not None:
            value = getattr(value, "name", value)
        if value == required:
            continue
        if value in unset:
            changes[attr] = required
            continue
        raise DDTreeConfigError(f"method 'ddtree' needs {attr}={required!r}, got {value!r}: {why}")
    attention_config = getattr(args, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    if backend is not None and getattr(backend, "name", backend) != ATTENTION_BACKEND:
        raise DDTreeConfigError(
            f"method 'ddtree' needs the target's attention backend {ATTENTION_BACKEND}, "
            f"got attention_config.backend={backend}"
        )
    if backend is not None and "attention_backend" in changes:
        del changes["attention_backend"]  # set through attention_config already; both would conflict
    tensor_parallel_size = getattr(args, "tensor_parallel_size", 1) or 1
    if cfg is not None and cfg.auto and tensor_parallel_size > 1:
        raise DDTreeConfigError(
            f"ddtree_budget \"auto\" runs with one GPU only (tensor_parallel_size={tensor_parallel_size}): each rank "
            "would choose its own budgets from its own timings; give a budget or a schedule by batch size"
        )
    for attr, why in _PARALLEL_LIMITS.items():
        value = getattr(args, attr, 1)
        if value not in (None, 1):
            raise DDTreeConfigError(f"method 'ddtree' supports {attr}=1 only, got {value}: {why}")
    v2 = environ.get(V2_RUNNER_ENV)
    if v2 is not None and v2.strip().lower() in ("1", "true"):
        raise DDTreeConfigError(f"method 'ddtree' runs on vLLM's V1 model runner; unset {V2_RUNNER_ENV} or set it to 0")
    if environ.get(BREAKABLE_GRAPHS_ENV) == "1":  # (vLLM's own reading: exactly "1" turns them on)
        raise DDTreeConfigError(
            f"method 'ddtree' runs vLLM's piecewise CUDA graphs, not breakable ones; unset {BREAKABLE_GRAPHS_ENV} or "
            "set it to 0"
        )
    return changes


def env_switch(environ: Mapping[str, str], name: str, default: str, meanings: Mapping[str, str]) -> bool:
    """A 0/1 environment switch (``default`` when unset); any other value is refused with both meanings."""
    value = environ.get(name, default).strip()
    if value not in ("0", "1"):
        first, second = default, "0" if default == "1" else "1"
        raise DDTreeConfigError(
            f"{name} must be {first} ({meanings[first]}, the default) or {second} ({meanings[second]}), got {value!r}"
        )
    return value == "1"


def env_choice(environ: Mapping[str, str], name: str, default: str, modes: Mapping[str, str]) -> str:
    """An environment setting of several values (``default`` when unset; case and spaces ignored); any other value
    is refused with every value's meaning."""
    value = environ.get(name, default).strip().lower()
    if value not in modes:
        choices = ", ".join(f"{k} ({v})" for k, v in modes.items())
        raise DDTreeConfigError(f"{name} must be one of {choices}; got {value!r}")
    return value


def commit_graphs_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the GDN commit after a FULL tree step replays a CUDA graph (on unless DDTREE_COMMIT_GRAPHS=0).

    Measured at the Qwen3.6-27B shape on one H200: the commit's host time per step 3.4-4.9 ms layer by layer
    (96 Triton launches), 0.29 ms as a graph (benches/results/gpu-h200-27b-shape-7ec2cc3).
    """
    return env_switch(environ, COMMIT_GRAPHS_ENV, "1", {"1": "commit graphs", "0": "commit layer by layer"})


def prefix_caching_choice(user: Optional[bool], environ: Mapping[str, str], kv_connector: bool) -> Optional[bool]:
    """The ``enable_prefix_caching`` to set, or ``None`` to keep the user's value or leave vLLM's default (on for
    attention-only targets, off for hybrids; ``check_target`` refuses it for hybrids and beside a KV connector).

    On by default since a GPU run showed it exact with cache hits on trees (``gpu-h200-pair-38e16ce``: tiny-qwen3,
    every e2e scenario, hits in every later request of ``shared_prefix``). ``DDTREE_PREFIX_CACHING=0`` turns it off
    and refuses an explicit ``True``. Unset beside a KV connector it is turned off rather than refused.
    """
    allowed = prefix_caching_allowed(environ)
    if not allowed and user:
        raise DDTreeConfigError(
            f"method 'ddtree' has prefix caching turned off by {PREFIX_CACHING_ENV}=0, got enable_prefix_caching=True;"
            f" unset {PREFIX_CACHING_ENV} or drop enable_prefix_caching"
        )
    if user is None and (not allowed or kv_connector):
        return False
    return None


def prefix_caching_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """``DDTREE_PREFIX_CACHING``: 1 (default) leaves prefix caching to vLLM's default, 0 turns it off."""
    meanings = {"1": "prefix caching as vLLM decides", "0": "prefix caching off"}
    return env_switch(environ, PREFIX_CACHING_ENV, "1", meanings)


#: Settings renamed before any release, by their former names.
FORMER_SETTINGS = {"DDTREE_WALK_GRAPHS": STEP_GRAPHS_ENV}


def hybrid_prefix_caching_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``DDTREE_HYBRID_PREFIX_CACHING``: 1 lets a hybrid (Gated DeltaNet) target cache prefixes with trees (vLLM's
    mamba cache mode "align", ``ddtree.vllm.mamba_align``); 0 (the default until an end-to-end run on a GPU has
    checked it) refuses prefix caching for hybrids, whose vLLM default is off."""
    meanings = {"0": "prefix caching refused for hybrid targets", "1": "hybrid prefixes cached with boundary commits"}
    return env_switch(environ, HYBRID_PREFIX_CACHING_ENV, "0", meanings)


def check_environment(environ: Mapping[str, str] = os.environ) -> List[str]:
    """Reads every ``DDTREE_*`` setting once, where the engine is configured, so that a value none of them takes is
    refused there (``DDTreeConfigError``, naming the setting and the values it takes) rather than in the engine's
    worker after the model has loaded. Returns a warning for each ``DDTREE_*`` name that is no setting (a misspelt
    switch changes nothing), with the nearest setting's name."""
    import difflib

    from ddtree.vllm.sliding_drafter import sliding_drafter_enabled  # (that module imports this one)

    readers = {
        COMMIT_GRAPHS_ENV: commit_graphs_enabled,
        COMMIT_IN_PLACE_ENV: commit_in_place_enabled,
        PREFIX_CACHING_ENV: prefix_caching_allowed,
        WHOLE_TREE_GDN_METADATA_ENV: whole_tree_gdn_metadata_enabled,
        DEVICE_ACCEPT_ENV: device_accept_enabled,
        LATE_TREES_ENV: late_trees_enabled,
        ASYNC_SCHEDULING_ENV: async_scheduling_enabled,
        STEP_GRAPHS_ENV: step_graphs_enabled,
        PRECAPTURE_ENV: precapture_mode,
        LAUNCH_AHEAD_ENV: launch_ahead_mode,
        TOPK_GRAPHS_ENV: topk_graphs_enabled,
        DEVICE_PLAN_ENV: device_plan_mode,
        DEVICE_PLAN_SUBSETS_ENV: device_plan_subsets_enabled,
        MIXED_WALK_GRAPHS_ENV: mixed_walk_graphs_enabled,
        SLIDING_DRAFTER_ENV: sliding_drafter_enabled,
        STRUCTURED_OUTPUTS_ENV: structured_outputs_enabled,
        HYBRID_PREFIX_CACHING_ENV: hybrid_prefix_caching_enabled,
    }
    for name, read in readers.items():
        if name in environ:
            read(environ)
    warnings = []
    for name in sorted(n for n in environ if n.startswith("DDTREE_") and n not in readers):
        near = (
            [FORMER_SETTINGS[name]] if name in FORMER_SETTINGS else difflib.get_close_matches(name, list(readers), n=1)
        )
        hint = f" (did you mean {near[0]}?)" if near else ""
        warnings.append(f"{name} is not a ddtree setting and changes nothing{hint}")
    return warnings


def _has_kv_connector(args: Any) -> bool:
    return getattr(args, "kv_transfer_config", None) is not None


def commit_in_place_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a commit graph reads the accepted paths and K/V moves of a walk that replayed its graph where that
    graph left them (keyed by their addresses; the whole commit one replay) instead of copies in its own buffers
    (three launches a step) and the moves apart. On unless DDTREE_COMMIT_IN_PLACE=0: through vLLM on an H200 its
    tokens and logprobs equalled the copies' bit for bit (the e2e harness, every scenario), and the commit's host
    time per 27B-shape step fell from 0.143 to 0.039 ms at batch 1 (``gpu-h200-5d593db``)."""
    return env_switch(environ, COMMIT_IN_PLACE_ENV, "1", {"1": "commit reads the walk's paths", "0": "commit copies"})


def step_graphs_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the device walk and the KV moves of a FULL tree step, and the plan's device side of a step of whole
    trees, replay CUDA graphs (on unless DDTREE_STEP_GRAPHS=0).

    The walk is ~40 small torch operations, 1.71 ms of host launches per batch-1 step at the Qwen3.6-27B shape
    (``gpu-h200-async-b798afe``); as a graph it was its inputs' copies and one replay (0.11 ms,
    ``gpu-h200-walk-graphs-6899f40``), now the target tokens' copy and one replay (the trees read in place). The
    plan's device side is ~10 launches (the layout into the fixed buffers, the positions, the tree tokens into
    vLLM's input ids), the KV moves two per attention layer.
    """
    return env_switch(environ, STEP_GRAPHS_ENV, "1", {"1": "step graphs", "0": "launch by launch"})


def mixed_walk_graphs_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """DDTREE_MIXED_WALK_GRAPHS: whether a step that is not a FULL graph's (a request's prefill beside the trees)
    also walks its trees through the walk graphs (with the step graphs on), when its trees are all of one size.

    Such a step's walk ran op by op: ~1.5 ms of host launches on an H100's host, on 15% of the verify steps of the
    pair under churn at batch 8, where they doubled ddtree's host work a step (0.91 ms against 0.47 with full
    batches, ``gpu-h100-pair-churn-subsets-0cecefa``). Its shapes are the trees' (``R`` trees of one size) once the
    drafter's row order is laid out over a fixed number of tokens (the scheduler's token budget) rather than the
    step's: one set of graphs per tree count and size, for the first ``runner.MAX_MIXED_WALK_SHAPES`` shapes met, and
    only for whole trees beside a prefill in an engine with FULL graphs (the rest op by op: cut trees near
    ``max_model_len``, PIECEWISE-only engines). On by default since ``gpu-h100-e2e-arrivals-b5124aa``:
    inside an engine it replayed on 5 of 8 such steps (the others captured their shapes), its outputs equal the op-by-op
    walk's token for token in every scenario of the e2e harness, 0 real divergences by the fp32 judge, and the run's
    accept part fell 0.090 -> 0.063 ms a verify step; the walk so graphed equals the walk op by op on an H100, 12-30 us
    of host against 826-1559 us (``gpu-h100-mixed-walk-graphs-d354b33``). 0 walks such steps op by op."""
    return env_switch(environ, MIXED_WALK_GRAPHS_ENV, "1", {"1": "mixed steps' walks as graphs", "0": "op by op"})


def precapture_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the placement and walk graphs of a step of whole trees are captured at start-up, for every size vLLM
    captures a FULL graph of, instead of at the first step of each size while serving (on unless
    ``DDTREE_PRECAPTURE=0``). A capture synchronizes the device; a batch shrinking request by request meets a new
    size at most steps of its first run. On the pair on an H200 (``gpu-h200-pair-38e16ce``) the timed runs met 0 / 2
    / 0 first runs at batch 1 / 8 / 32 against 0 / 6 / 20 without it, every e2e scenario exact; start-up took 1 s
    longer and its graphs reserved 130-170 MB from the start. The commit's graphs follow with ``all``
    (:func:`precapture_commits`). Late trees only (the one-GPU default): filler trees of each size have the real
    steps' shapes there."""
    return precapture_mode(environ) != "0"


def precapture_commits(environ: Mapping[str, str] = os.environ) -> bool:
    """``DDTREE_PRECAPTURE=all`` (experimental): the commit's graphs of every FULL size too (the GDN commit, with the
    K/V moves, for hybrid targets; the K/V moves for attention-only ones), captured at
    start-up after the walk's: their first run writes the filler step's commit into the state slots and K/V slots
    of vLLM's capture run (its dummy blocks) before any request exists. Without it each is captured at its size's
    first step while serving (~27 ms each on the pair; 67 such steps over an e2e engine's life,
    ``gpu-h200-pair-38e16ce``), and ``auto``'s probes, which leave out steps that captured, measure less. On the
    pair's bench (``gpu-h200-pair-c0abd2f``): no first run left at any batch size, exact; not yet through the e2e's
    scenarios."""
    return precapture_mode(environ) == "all"


def precapture_mode(environ: Mapping[str, str] = os.environ) -> str:
    """``DDTREE_PRECAPTURE``: ``"1"`` (default), ``"0"`` or ``"all"``; anything else is refused with the meanings."""
    value = environ.get(PRECAPTURE_ENV, "1").strip().lower()
    if value not in PRECAPTURE_MODES:
        raise DDTreeConfigError(
            f"{PRECAPTURE_ENV} must be 1 (step graphs captured at start-up, the default), 0 (at a size's first "
            f"step) or all (the commit's graphs at start-up too, experimental), got {value!r}"
        )
    return value


def topk_graphs_enabled(environ: Mapping[str, str] = os.environ, tensor_parallel_size: int = 1) -> bool:
    """Whether the drafter's top-K after each drafter pass (its logits, their top-K and the packed copy for the
    host: a few launches, one of them Triton's) replays one CUDA graph per number of rows
    (``graphs.DraftTopKGraphs``; ``DDTREE_TOPK_GRAPHS=1``). Experimental, off by default: exact on the pair (bench
    and e2e, ``gpu-h200-pair-c0abd2f``), with no tokens/s gain above the rounds' spread there. One GPU only (with
    tensor parallelism the logits are gathered across ranks inside the computation)."""
    meanings = {"0": "the drafter's top-K launch by launch", "1": "the drafter's top-K as CUDA graphs"}
    on = env_switch(environ, TOPK_GRAPHS_ENV, "0", meanings)
    if on and tensor_parallel_size > 1:
        raise DDTreeConfigError(
            f"{TOPK_GRAPHS_ENV}=1 runs with one GPU only (tensor_parallel_size={tensor_parallel_size}): the drafter's "
            "logits are gathered across ranks; unset it"
        )
    return on


def device_plan_mode(environ: Mapping[str, str] = os.environ) -> str:
    """DDTREE_DEVICE_PLAN: whether a steady step (every request verifies its last proposal's tree, whole, far from
    ``max_model_len``) has its trees built and laid out on the device inside one CUDA graph with the placement, so
    that the host neither waits for the drafter's top-K nor builds trees (``ddtree.vllm.device_plan``).
    ``"auto"`` (default): on where the engine has what :func:`device_plan_lacks` lists, the host plan otherwise;
    ``"1"``: on, and refused at start-up where the engine lacks any of it; ``"0"``: every step planned on the host.
    The default since ``gpu-h200-device-plan-9e8b443``: exact in every e2e scenario, less host work a step."""
    return env_choice(environ, DEVICE_PLAN_ENV, "auto", DEVICE_PLAN_MODES)


def device_plan_subsets_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """DDTREE_DEVICE_PLAN_SUBSETS: whether the device plan also takes a step whose requests are some of the last
    proposal's, in any order, each verifying its whole tree (requests finished since the proposal, and vLLM moved
    others into their slots: one step each time a request ends). Their top-K rows are gathered on the device by an
    uploaded row index. On by default since ``gpu-h100-e2e-subsets-0cecefa`` and
    ``gpu-h100-pair-churn-subsets-0cecefa``: exact in every e2e scenario and under churn, equal to the host plan
    compiled, and not slower; ``"0"`` leaves those steps to the host plan."""
    return env_switch(
        environ, DEVICE_PLAN_SUBSETS_ENV, "1", {"1": "subset steps planned on the device", "0": "on the host"}
    )


DEVICE_PLAN_MODES = {
    "auto": "steady steps' trees built on the device where the engine allows it, the default",
    "1": "the same, refused at start-up where the engine does not allow it",
    "0": "every step's trees built on the host",
}


def device_plan_lacks(
    async_scheduling: bool, late_trees: bool, device_walk: bool, step_graphs: bool, on_gpu: bool
) -> List[str]:
    """What the device plan (``DDTREE_DEVICE_PLAN``) needs and the engine lacks (empty: nothing)."""
    lacking = []
    if not on_gpu:
        lacking.append("a CUDA device (its plan is CUDA graphs)")
    if not async_scheduling:
        lacking.append("asynchronous scheduling (DDTREE_ASYNC_SCHEDULING=1: its steps are the ones planned so)")
    if not late_trees:
        lacking.append("late trees (DDTREE_LATE_TREES=1)")
    if not device_walk:
        lacking.append("the device walk (DDTREE_DEVICE_ACCEPT=1: the host never sees the trees to walk them)")
    if not step_graphs:
        lacking.append(
            "step graphs (DDTREE_STEP_GRAPHS=1: launched one by one, its Triton kernels cost the host more "
            "than the plan they replace)"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        lacking.append("triton (its kernels)")
    return lacking


def launch_ahead_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether, under asynchronous scheduling, a step of whole trees that replays a FULL graph queues its input copy,
    its placement and its forward before its trees are built, behind a device-side gate the host releases once they
    are (``ddtree.vllm.launch_gate``; on unless DDTREE_LAUNCH_AHEAD=0). Without it the GPU idles from the drafter's
    end through the tree build, the placement's launches and vLLM's forward launch."""
    return launch_ahead_mode(environ) != "0"


def launch_ahead_mode(environ: Mapping[str, str] = os.environ) -> str:
    """DDTREE_LAUNCH_AHEAD: ``"1"`` (default) gates a step only while the drafter's top-K is still on its way (once
    it has landed there is nothing to overlap, and gating cost ~1 ms per step on the test pair,
    ``gpu-h200-pair-launch-ahead-632c917``); ``"0"`` never; ``"always"`` gates every eligible step, landed or not:
    slower, for tests that must run the gate on a pair whose drafter always lands first (the e2e harness)."""
    return env_choice(environ, LAUNCH_AHEAD_ENV, "1", LAUNCH_AHEAD_MODES)


LAUNCH_AHEAD_MODES = {
    "1": "the forward queued before the trees while the drafter runs, the default",
    "0": "queued after them",
    "always": "queued before them on every eligible step, for tests",
}


def whole_tree_gdn_metadata_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether whole-tree steps build vLLM's GDN metadata without its host classification (patch 10; on unless
    DDTREE_WHOLE_TREE_GDN_METADATA=0, which leaves every build to vLLM)."""
    meanings = {"1": "ddtree's whole-tree GDN metadata", "0": "vLLM's build every step"}
    return env_switch(environ, WHOLE_TREE_GDN_METADATA_ENV, "1", meanings)


def device_accept_enabled(environ: Mapping[str, str] = os.environ, tensor_parallel_size: int = 1) -> bool:
    """Whether the trees are walked on the device (``ddtree.vllm.device_accept``) instead of by the Rust core on
    the host: ``DDTREE_DEVICE_ACCEPT``, by default on with one GPU (exact on the pair under every scenario of the
    e2e harness, 3.5 ms less per batch-1 step at the 27B shape: ``benches/results/gpu-h200-late-trees-33fbda4``)
    and off with tensor parallelism (not yet run there)."""
    meanings = {"0": "the Rust walk on the host", "1": "the walk on the device"}
    return env_switch(environ, DEVICE_ACCEPT_ENV, _on_with_one_gpu(tensor_parallel_size), meanings)


def _on_with_one_gpu(tensor_parallel_size: int) -> str:
    """The default of a switch measured with one GPU only: on there, off under tensor parallelism."""
    return "1" if tensor_parallel_size == 1 else "0"


def late_trees_enabled(environ: Mapping[str, str] = os.environ, tensor_parallel_size: int = 1) -> bool:
    """Whether the drafter's proposal is turned into trees at the next verification instead of at proposal:
    ``DDTREE_LATE_TREES``, by default on with one GPU and off with tensor parallelism (not yet run there).

    Late, the drafter's top-K travels to the host while the engine schedules and prepares the next step, and vLLM's
    scheduler gets placeholder drafts of each tree's size (all it needs); the trees are built, and their tokens
    written into the step's input ids, right after vLLM's input preparation. With the device walk, 3.2 ms less per
    batch-1 step at the 27B shape, the same outputs on the pair (``gpu-h200-late-trees-33fbda4``); see
    docs/async-scheduling.md."""
    meanings = {"0": "trees built at proposal", "1": "trees built at the next verification"}
    return env_switch(environ, LATE_TREES_ENV, _on_with_one_gpu(tensor_parallel_size), meanings)


def async_scheduling_enabled(environ: Mapping[str, str] = os.environ, tensor_parallel_size: int = 1) -> bool:
    """The ``DDTREE_ASYNC_SCHEDULING`` switch: vLLM's asynchronous scheduling, by default on with one GPU (exact on
    the pair in every scenario of the e2e harness, preemption and a budget schedule's FULL graphs included:
    ``gpu-h200-async-schedule-1e7d2a7``, ``gpu-h200-async-977ad3d``; 1.21x the chain's batch-1 step at the 27B shape
    instead of 1.4x synchronously: ``gpu-h200-async-b798afe``) and off under tensor parallelism (not yet run
    there). Whether an engine schedules asynchronously: :func:`async_scheduling_choice`."""
    meanings = {"0": "synchronous scheduling", "1": "vLLM's asynchronous scheduling"}
    return env_switch(environ, ASYNC_SCHEDULING_ENV, _on_with_one_gpu(tensor_parallel_size), meanings)


def _async_scheduling_state(
    environ: Mapping[str, str], tensor_parallel_size: int, cfg: Optional["DDTreeConfig"]
) -> Tuple[bool, List[str]]:
    """``(switch, lacking)``: the ``DDTREE_ASYNC_SCHEDULING`` switch, and what the engine lacks for asynchronous
    scheduling when the switch is on (:func:`async_scheduling_lacks` of the walk and late-tree switches)."""
    switch = async_scheduling_enabled(environ, tensor_parallel_size)
    if not switch:
        return False, []
    late_device_walk = device_accept_enabled(environ, tensor_parallel_size) and late_trees_enabled(
        environ, tensor_parallel_size
    )
    return True, async_scheduling_lacks(late_device_walk, cfg)


def async_scheduling_lacks(
    late_device_walk: bool, cfg: Optional["DDTreeConfig"], top_k: Optional[int] = None
) -> List[str]:
    """What asynchronous scheduling needs and an engine lacks (empty: nothing): the step's trees built late and
    walked on the device (``late_device_walk``: no host wait between steps), and trees that fill every budget
    (vLLM's scheduler gives each request the step's whole budget in placeholders; ``top_k`` as resolved, default the
    user's)."""
    lacking = []
    if not late_device_walk:
        lacking.append(f"the tree walk on the device and late trees ({DEVICE_ACCEPT_ENV}=1, {LATE_TREES_ENV}=1)")
    unfilled = cfg.budgets_unfilled(top_k) if cfg is not None else []
    if unfilled:
        k = cfg.top_k if top_k is None else top_k
        lacking.append(f"trees that fill every budget (top-K {k} at depth {cfg.draft_len} cannot fill {unfilled})")
    return lacking


def async_scheduling_choice(
    user_value: Optional[bool],
    environ: Mapping[str, str] = os.environ,
    tensor_parallel_size: int = 1,
    cfg: Optional["DDTreeConfig"] = None,
) -> Optional[bool]:
    """vLLM's ``async_scheduling`` for a ddtree engine: the value to set, or None to keep the user's.

    Unset, it follows ``DDTREE_ASYNC_SCHEDULING`` (on with one GPU) where the engine has what asynchronous scheduling
    needs, else synchronous. A user's ``False`` is kept (unless the switch was set to 1 too: a contradiction); a
    user's ``True`` needs the switch on and nothing :func:`async_scheduling_lacks` lists. A switch set to 1 by
    hand on an engine that lacks something is refused rather than quietly run synchronously.
    """
    switch, lacking = _async_scheduling_state(environ, tensor_parallel_size, cfg)
    set_by_hand = ASYNC_SCHEDULING_ENV in environ
    if user_value is False:
        if set_by_hand and switch:
            raise DDTreeConfigError(
                f"{ASYNC_SCHEDULING_ENV}=1 asks for vLLM's asynchronous scheduling but async_scheduling=False was "
                "given too; drop one of them"
            )
        return None
    if not switch:
        if user_value:
            raise DDTreeConfigError(
                f"method 'ddtree' runs vLLM's asynchronous scheduling only with {ASYNC_SCHEDULING_ENV}=1 (its default "
                f"with one GPU; tensor_parallel_size={tensor_parallel_size}, switch "
                f"{environ.get(ASYNC_SCHEDULING_ENV, 'unset')}): got async_scheduling=True"
            )
        return False
    if lacking and (user_value or set_by_hand):
        raise DDTreeConfigError("DDTree under vLLM's asynchronous scheduling needs " + "; ".join(lacking))
    if lacking:
        return False
    return None if user_value else True


#: vLLM's CUDA-graph modes a ddtree engine runs. A step in which every request verifies a whole tree of a
#: captured size replays a FULL graph captured from trees of the engine's budget (the tree layout lives in
#: persistent buffers, ``ddtree.vllm.graphs``); other steps (prefills, truncated trees) replay PIECEWISE
#: graphs, in which attention and the GDN core run eagerly between the captured pieces. Mixed-batch FULL
#: graphs ("FULL") would need a tree attention that captures any batch shape: refused.
SERVED_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
#: What an engine whose user chose no mode runs (vLLM's own default).
DEFAULT_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"


def cudagraph_mode_choice(requested: Optional[str], enforce_eager: Optional[bool]) -> Optional[str]:
    """The cudagraph_mode a ddtree engine needs: a mode to set, or ``None`` to keep the user's.

    ``requested`` is the name of the user's ``compilation_config.cudagraph_mode`` (None: unset).
    """
    if enforce_eager or requested in SERVED_CUDAGRAPH_MODES:
        return None
    if requested is None:
        return DEFAULT_CUDAGRAPH_MODE
    raise DDTreeConfigError(
        f"method 'ddtree' does not support compilation_config.cudagraph_mode={requested} (FULL graphs of mixed "
        f"batches); use one of {', '.join(SERVED_CUDAGRAPH_MODES)}, or leave it unset ({DEFAULT_CUDAGRAPH_MODE})"
    )


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """vLLM's per-step limits as a ddtree engine runs them, and why they changed (None: unchanged)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    reason: Optional[str] = None


def fit_batch_limits(
    *,
    budget: int,
    reserve_per_request: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seqs_from_user: bool,
    tokens_from_user: bool,
) -> BatchLimits:
    """Limits under which every running request can verify its whole tree in one step.

    A step verifies ``budget + 1`` tokens per request, and vLLM keeps ``reserve_per_request`` more per
    sequence free for the drafter (its depth L - 1 for DFlash), so full trees for ``max_num_seqs`` requests
    need ``max_num_seqs * (budget + 1 + reserve_per_request)`` batched tokens. What the user left to vLLM's
    defaults is fitted (fewer sequences, or more batched tokens when the user fixed the sequences); two
    user-set values that leave no room for even one tree are refused, naming values that work. vLLM's own
    check (``max_num_scheduled_tokens``) would otherwise stop the engine with a negative token count.
    """
    per_request = budget + 1 + reserve_per_request
    if max_num_batched_tokens >= max_num_seqs * per_request:
        return BatchLimits(max_num_seqs, max_num_batched_tokens)
    if not seqs_from_user:
        seqs = max(1, max_num_batched_tokens // per_request)
        tokens = max_num_batched_tokens if seqs * per_request <= max_num_batched_tokens else per_request
        if tokens_from_user and tokens != max_num_batched_tokens:
            raise DDTreeConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one tree of budget {budget} "
                f"({budget + 1} tokens plus {reserve_per_request} kept for the drafter); set "
                f"--max-num-batched-tokens >= {per_request} or a smaller ddtree_budget"
            )
        return BatchLimits(
            seqs,
            tokens,
            (
                f"max_num_seqs {max_num_seqs} -> {seqs}"
                + (
                    f", max_num_batched_tokens {max_num_batched_tokens} -> {tokens}"
                    if tokens != max_num_batched_tokens
                    else ""
                )
                + f": each request verifies {budget + 1} tree tokens per step and keeps {reserve_per_request} for "
                f"the drafter, and {max_num_batched_tokens} batched tokens hold {seqs} such requests"
            ),
        )
    if not tokens_from_user:
        tokens = max_num_seqs * per_request
        return BatchLimits(
            max_num_seqs,
            tokens,
            (
                f"max_num_batched_tokens {max_num_batched_tokens} -> {tokens}: max_num_seqs={max_num_seqs} requests "
                f"verify {budget + 1} tree tokens each per step and keep {reserve_per_request} each for the drafter"
            ),
        )
    if max_num_batched_tokens - reserve_per_request * max_num_seqs >= budget + 1:
        return BatchLimits(max_num_seqs, max_num_batched_tokens)  # served; crowded steps verify partial trees
    raise DDTreeConfigError(
        f"max_num_batched_tokens={max_num_batched_tokens} with max_num_seqs={max_num_seqs} leaves "
        f"{max_num_batched_tokens - reserve_per_request * max_num_seqs} tokens per step once vLLM keeps "
        f"{reserve_per_request} per sequence for the drafter, less than one tree of budget {budget} "
        f"({budget + 1} tokens); set --max-num-batched-tokens >= {max_num_seqs * per_request} or "
        f"--max-num-seqs <= {max(1, max_num_batched_tokens // per_request)}"
    )


#: Whole trees per step that get a CUDA graph of their own size: every count up to this, then every
#: :data:`TREE_GRAPH_STRIDE`-th up to :data:`MAX_GRAPHED_TREES`.
ALL_TREE_GRAPHS_UP_TO = 32
TREE_GRAPH_STRIDE = 8
MAX_GRAPHED_TREES = 128
#: vLLM's own default sizes stop here (``VllmConfig._set_cudagraph_sizes``).
VLLM_DEFAULT_MAX_CAPTURE = 512


def vllm_default_capture_sizes(max_size: int) -> list:
    """vLLM 0.25's default capture sizes up to ``max_size``: 1, 2, 4, every 8th to 248, every 16th from 256."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size + 1, 256), 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def tree_capture_sizes(budget: int, max_num_seqs: int, max_num_batched_tokens: int) -> list:
    """CUDA-graph capture sizes (tokens per step) for a ddtree engine whose user set none.

    vLLM's defaults stop at 512 tokens, which hold seven trees of budget 64; a step verifying more trees
    would run without graphs. These sizes add every whole number of trees ``k * (budget + 1)`` (up to
    ``max_num_seqs`` trees and ``max_num_batched_tokens`` tokens) to vLLM's defaults, so a step of ``k``
    full trees replays a graph of exactly its size.
    """
    small = vllm_default_capture_sizes(min(VLLM_DEFAULT_MAX_CAPTURE, max_num_batched_tokens))
    trees = [k * (budget + 1) for k in graphed_tree_counts(max_num_seqs) if k * (budget + 1) <= max_num_batched_tokens]
    return sorted(set(small) | set(trees))


def graphed_tree_counts(max_num_seqs: int) -> list:
    """The numbers of whole trees per step that get a CUDA graph (every one up to :data:`ALL_TREE_GRAPHS_UP_TO`,
    then every :data:`TREE_GRAPH_STRIDE`-th), up to ``max_num_seqs``."""
    counts = list(range(1, ALL_TREE_GRAPHS_UP_TO + 1))
    counts += list(range(ALL_TREE_GRAPHS_UP_TO + TREE_GRAPH_STRIDE, MAX_GRAPHED_TREES + 1, TREE_GRAPH_STRIDE))
    return [k for k in counts if k <= max_num_seqs]


def dynamic_sd_schedule(cfg: DDTreeConfig, max_num_seqs: int) -> List[Tuple[int, int, int]]:
    """A budget schedule as vLLM's ``num_speculative_tokens_per_batch_size``: ``(first, last, budget)``, inclusive
    batch-size ranges up to ``max_num_seqs``.

    Under asynchronous scheduling vLLM's scheduler, not the runner, sets how many placeholder drafts each request
    gets for the next step: ``num_speculative_tokens`` (the largest budget), or with this schedule the entry of the
    step's batch size, which is the budget the runner's proposal for that step used (``DDTreeConfig.budget_for``
    of the same request count).
    """
    schedule = [(first, budget) for first, budget in cfg.budget_schedule or ((1, cfg.budget),) if first <= max_num_seqs]
    lasts = [first - 1 for first, _ in schedule[1:]] + [max_num_seqs]
    return [(first, last, budget) for (first, budget), last in zip(schedule, lasts)]


def schedule_tree_graphs(
    cfg: DDTreeConfig, tree_tokens: Callable[[int], int], max_num_seqs: int, max_tokens: int
) -> List[Tuple[int, int]]:
    """The FULL graphs a budget schedule's smaller budgets replay, as ``(tokens per tree, trees)``, ascending.

    vLLM 0.25 captures FULL graphs for one query length, ``budget + 1`` (the engine's largest budget). A step in
    which every request verifies a whole tree of a smaller budget ``b`` has another: it replays a graph of
    ``n`` trees of ``tree_tokens(b)`` tokens, captured for every graphed count ``n`` of the batch sizes at which
    the schedule picks ``b`` (a step verifies the trees proposed at the step before, whose batch size chose their
    budget; a batch that shrank since replays PIECEWISE once). ``max_tokens`` bounds a graph (the largest capture
    size). With ``auto`` every candidate at every graphed count. Empty without a schedule.
    """
    graphs = set()
    if cfg.auto:  # any candidate at any batch size
        ranges = [(1, max_num_seqs, budget) for budget in cfg.budgets]
    else:
        ranges = dynamic_sd_schedule(cfg, max_num_seqs)
    for first, last, budget in ranges:
        if budget == cfg.budget:
            continue  # the engine's own query length: vLLM captures those graphs
        size = tree_tokens(budget)
        graphs.update(
            (size, n) for n in graphed_tree_counts(max_num_seqs) if first <= n <= last and n * size <= max_tokens
        )
    return sorted(graphs)


def resolve_draft_len(cfg: DDTreeConfig, drafter_block_size: Optional[int]) -> DDTreeConfig:
    """Fills L from the drafter's ``block_size`` (L = block_size - 1) and checks they agree."""
    from_block = None
    if drafter_block_size is not None:
        if not isinstance(drafter_block_size, int) or drafter_block_size < 2:
            raise DDTreeConfigError(f"the drafter's block_size must be an integer >= 2, got {drafter_block_size!r}")
        from_block = drafter_block_size - 1
    if cfg.draft_len is None:
        if from_block is None:
            raise DDTreeConfigError(
                "cannot tell the drafter's depth: its config has no block_size; "
                "set num_speculative_tokens to its block size - 1"
            )
        smallest = cfg.budget if cfg.auto else cfg.budgets[0]
        if smallest < from_block:
            raise DDTreeConfigError(
                f"{'ddtree_max_budget' if cfg.auto else 'ddtree_budget'}={smallest} is smaller than the drafter's "
                f"depth {from_block} (block_size - 1); "
                "this adapter needs budget >= depth"
            )
        return dataclasses.replace(cfg, draft_len=from_block)
    if from_block is not None and from_block != cfg.draft_len:
        raise DDTreeConfigError(
            f"num_speculative_tokens={cfg.draft_len} does not match the drafter's block_size {drafter_block_size} "
            f"(it must be block_size - 1 = {from_block})"
        )
    return cfg


#: Hybrid targets whose recurrent layers are vLLM's ``QwenGatedDeltaNetAttention``
#: (the layer whose forward DDTree's tree verification replaces for tree tokens).
GDN_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def check_target(
    *,
    is_hybrid: bool,
    uses_mrope: bool,
    sliding_window: Optional[int],
    kv_cache_dtype: str,
    vocab_size: int,
    cfg: DDTreeConfig,
    use_v2_model_runner: bool = False,
    has_logits_processors: bool = False,
    architecture: str = "",
    mamba_cache_mode: str = "none",
    logprobs_mode: str = "raw_logprobs",
    prefix_caching: bool = False,
    kv_connector: bool = False,
    hybrid_prefix_caching: bool = False,
) -> None:
    """Refuses targets this adapter cannot verify exactly.

    M-RoPE targets are accepted: a tree token's three rotary sections are its
    root's plus the node's depth (the runner writes them). ``hybrid_prefix_caching``:
    ``DDTREE_HYBRID_PREFIX_CACHING``.
    """
    if prefix_caching and is_hybrid and not hybrid_prefix_caching:
        raise DDTreeConfigError(
            "method 'ddtree' caches prefixes of a hybrid target only with "
            f"{HYBRID_PREFIX_CACHING_ENV}=1 (experimental: boundary commits into vLLM's per-block states, "
            "mamba_cache_mode 'align'); set it, or enable_prefix_caching=False (vLLM's own default for hybrids)"
        )
    if prefix_caching and kv_connector:
        raise DDTreeConfigError(
            "method 'ddtree' with prefix caching refuses a KV connector: a connector may read a block before the "
            "step's tree K/V moves reach it; drop kv_transfer_config or prefix caching"
        )
    if is_hybrid:
        if architecture not in GDN_ARCHITECTURES:
            raise DDTreeConfigError(
                f"method 'ddtree' supports hybrid targets whose recurrent layers are Gated DeltaNet "
                f"({', '.join(GDN_ARCHITECTURES)}); got {architecture or 'an unknown architecture'}"
            )
        allowed = ("none", "align") if prefix_caching else ("none",)
        if mamba_cache_mode not in allowed:
            raise DDTreeConfigError(
                f"method 'ddtree' needs mamba_cache_mode {' or '.join(repr(m) for m in allowed)} for this hybrid "
                f"target (got {mamba_cache_mode!r}): the tree commit keeps one running state per request, and "
                "prefix caching's per-block states are written by boundary commits ('align')"
            )
    if sliding_window is not None:
        raise DDTreeConfigError("method 'ddtree' does not support sliding-window attention in the target yet")
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise DDTreeConfigError(f"method 'ddtree' needs an unquantized KV cache, got kv_cache_dtype={kv_cache_dtype!r}")
    if use_v2_model_runner:
        raise DDTreeConfigError(f"method 'ddtree' runs on vLLM's V1 model runner; set {V2_RUNNER_ENV}=0")
    if logprobs_mode not in ("raw_logprobs", "raw_logits"):
        raise DDTreeConfigError(
            f"method 'ddtree' returns logprobs of the target's raw distribution at each tree node; "
            f"logprobs_mode={logprobs_mode!r} is not supported (use raw_logprobs or raw_logits)"
        )
    if has_logits_processors:
        raise DDTreeConfigError("method 'ddtree' does not support custom logits processors")
    if cfg.top_k is not None and cfg.top_k > vocab_size:
        raise DDTreeConfigError(f"ddtree_top_k={cfg.top_k} exceeds the vocabulary size {vocab_size}")


def structured_outputs_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``DDTREE_STRUCTURED_OUTPUTS``: 1 serves structured outputs (JSON schema, regex, grammar, choice) with a grammar
    mask per tree node (``ddtree.vllm.grammar``, patch 12); 0 (the default until an end-to-end run on a GPU has
    checked it) refuses them at admission."""
    meanings = {"0": "structured outputs refused", "1": "structured outputs served with per-node grammar masks"}
    return env_switch(environ, STRUCTURED_OUTPUTS_ENV, "0", meanings)


def structured_outputs_refusal(
    backend: Optional[str],
    world_size: int,
    reasoning_parser: Optional[str],
    enable_in_reasoning: bool,
    environ: Mapping[str, str] = os.environ,
) -> Optional[str]:
    """Why a structured-output request cannot be served (None: it can). ``backend`` is the one vLLM chose for it.

    The masks follow each tree branch with xgrammar's matcher (one walk of the tree per request); they are computed
    in the scheduler from the trees the runner built, which share one process only with one GPU. vLLM's masks
    during and at the end of a reasoning section (a reasoning parser) are decided for a chain of drafts, so those
    stay refused unless the grammar also holds inside the reasoning (``enable_in_reasoning``)."""
    if not structured_outputs_enabled(environ):
        return f"structured outputs (experimental with trees: {STRUCTURED_OUTPUTS_ENV}=1 serves them)"
    if world_size > 1:
        return "structured outputs with tensor or pipeline parallelism (served with one GPU only)"
    if reasoning_parser and not enable_in_reasoning:
        return (
            "structured outputs after a reasoning section (a reasoning parser is set; served with "
            "enable_in_reasoning, which applies the grammar from the first token)"
        )
    if backend != "xgrammar":
        return (
            f"structured outputs through the {backend!r} backend (trees are masked with xgrammar's: set the "
            "structured-outputs backend to 'xgrammar', or 'auto' with a grammar xgrammar accepts)"
        )
    return None


def structured_outputs_start_up_warning(
    backend: str,
    world_size: int,
    reasoning_parser: Optional[str],
    enable_in_reasoning: bool,
    environ: Mapping[str, str] = os.environ,
) -> Optional[str]:
    """With ``DDTREE_STRUCTURED_OUTPUTS=1``, what the engine's own settings (its structured-outputs ``backend``, ...)
    make it refuse every structured-output request for, said once at start-up rather than in each request's 400
    (None: it serves them, ``auto`` picking xgrammar for every grammar xgrammar accepts)."""
    if not structured_outputs_enabled(environ):
        return None
    chosen = "xgrammar" if backend in ("auto", "xgrammar") else backend
    refusal = structured_outputs_refusal(chosen, world_size, reasoning_parser, enable_in_reasoning, environ)
    if refusal is None:
        return None
    return f"{STRUCTURED_OUTPUTS_ENV}=1, but this engine refuses every request with {refusal}"


def unsupported_sampling_reasons(
    params: Any, structured_outputs: Callable[[Optional[str]], Optional[str]] = lambda backend: "structured outputs"
) -> List[Tuple[str, str]]:
    """Why a request's ``SamplingParams`` cannot be served by the tree: ``(parameter, reason)`` pairs (empty:
    it can).

    Per-node verification samples each node from the target's own
    distribution under the request's settings, each node with its own history
    (committed output plus its root path: penalties, bad words, min_tokens,
    a grammar's mask); what the per-node sampler does not model (arbitrary
    per-request logits processors, a thinking budget) is refused rather than
    served wrongly. ``structured_outputs(backend)`` says why a request with
    structured outputs is refused (None: served; by default refused).
    """
    reasons = []

    def get(name, default=None):
        return getattr(params, name, default)

    structured = get("structured_outputs")
    if structured is not None or get("guided_decoding") is not None:
        refusal = structured_outputs(getattr(structured, "_backend", None))
        if refusal is not None:
            reasons.append(("structured_outputs", refusal))
    if get("logits_processors"):
        reasons.append(("logits_processors", "per-request logits processors"))
    if get("thinking_token_budget") is not None:
        reasons.append(("thinking_token_budget", "thinking_token_budget"))
    return reasons
