"""DDTree vs vLLM's DFlash chain at Qwen3.6-27B's exact shapes, dummy weights, one GPU (issue: hybrid GDN).

    python3 benches/bench_qwen36_shape.py --out DIR [--engines dflash,ddtree16,ddtree64,ddtree256] [--batch 1,8] [--tp 2]

Target: ``Qwen3_5ForConditionalGeneration`` with Qwen3.6-27B's text config (64 layers: 48 Gated DeltaNet +
16 gated attention, hidden 5120, 24/4 heads of 256, GDN 16 key / 48 value heads of 128, conv 4, partial
rotary 0.25 with M-RoPE sections [11, 11, 10], vocab 248320, fp32 recurrent state); drafter: the released
DFlash drafter's shape (5 layers, block 16, target layers [1, 16, 31, 46, 61]). ``load_format="dummy"``
for both, so the drafter is never accepted and every step emits one token: steps/s = tokens/s per sequence.
Every engine runs under CUDA graphs as vLLM does by default (FULL_AND_PIECEWISE for vLLM's chain and for
ddtree, whose whole-tree steps replay FULL graphs); ``--eager`` runs every engine eagerly. Each engine runs in its
own subprocess.

Per engine it prints and writes (DIR/bench_qwen36_shape.json):
* recurrent-state memory reserved per request (the engine's own KV-cache spec: GDN layers x state blocks
  per request x page size) and the KV-cache capacity vLLM reports;
* per batch size: ms per step (a 64-token generate / 64, prefill included, as earlier records) and ms per decode
  step (the same generate less a prefill-only one of the same prompts, / 63);
* ddtree: host (CPU) milliseconds per verification step, by part (plan, accept, tree build, commit plan);
* with ``--profile-batches``: each engine's torch.profiler tables, and for every ddtree engine profiled beside
  ``dflash`` at a batch size, GPU time per step by kernel family against the chain's (where the gap is).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

from gpu_profile import (
    counter_deltas,
    enable_scopes,
    family_comparison,
    host_ms_fields,
    inprocess_scheduler,
    profile_generate,
    scopes_on,
)

VOCAB = 248320
ROOT = "/tmp/qwen36_shape"
PROMPT_LEN = 512
OUT_TOKENS = 64


#: The drafter directory with the released drafter's ``layer_types`` (beside ``drafter``, the all-full-attention one).
SLIDING_DRAFTER_DIR = "drafter-sliding"
RELEASED_LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


def _tree(budget, **env):
    """A ddtree engine of the released drafter's depth, with environment switches."""
    spec = {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_budget": budget}
    return dict(spec, env=env) if env else spec


ENGINES = {
    "plain": None,
    "dflash": {"method": "dflash", "num_speculative_tokens": 15},
    "ddtree16": _tree(16),
    "ddtree64": _tree(64),
    "ddtree256": _tree(256),
    # Budget schedules: 64 below 8 drafting requests, 16 (or 32) from 8 on; each budget's whole-tree steps replay
    # FULL graphs of their own trees (``full_graph_steps_by_tree_tokens`` in a row says which ran).
    "ddtree64to16": _tree({"1": 64, "8": 16}),
    "ddtree64to32": _tree({"1": 64, "8": 32}),
    # Without the GDN commit graphs (DDTREE_COMMIT_GRAPHS=0): 96 commit launches per step at this shape.
    "ddtree64-layercommit": _tree(64, DDTREE_COMMIT_GRAPHS="0"),
    # The tree walk on the device and the trees built at the next verification under synchronous scheduling (the
    # TP-1 default before asynchronous scheduling became it), and the host paths they replaced.
    "ddtree64-late": _tree(64, DDTREE_DEVICE_ACCEPT="1", DDTREE_LATE_TREES="1", DDTREE_ASYNC_SCHEDULING="0"),
    "ddtree64-host": _tree(64, DDTREE_DEVICE_ACCEPT="0", DDTREE_LATE_TREES="0"),
    # vLLM's asynchronous scheduling (the TP-1 default, set explicitly; an engine setting, so no in-process A/B).
    "ddtree64-async": _tree(64, DDTREE_ASYNC_SCHEDULING="1"),
    # Smaller fixed budgets under async: the step costs a schedule (or `auto`) would choose between.
    "ddtree16-async": _tree(16, DDTREE_ASYNC_SCHEDULING="1"),
    "ddtree32-async": _tree(32, DDTREE_ASYNC_SCHEDULING="1"),
    # ... with a budget schedule: vLLM's asynchronous scheduler places each step's budget in drafts.
    "ddtree64to16-async": _tree({"1": 64, "8": 16}, DDTREE_ASYNC_SCHEDULING="1"),
    # Trees of 2^k tokens with their root (budgets 2^k - 1): whole 16-row blocks of the tree GDN and attention
    # kernels, where budget 2^k's one extra token opens a block of its own.
    "ddtree15": _tree(15),
    "ddtree63": _tree(63),
    "ddtree255": _tree(255),
    "ddtree63to15": _tree({"1": 63, "8": 15}),
    "ddtree63-late": _tree(63, DDTREE_DEVICE_ACCEPT="1", DDTREE_LATE_TREES="1", DDTREE_ASYNC_SCHEDULING="0"),
    "ddtree-auto": _tree("auto"),  # candidates 15, 31, 63 (the default maximum)
    # The forward queued after the trees are built (DDTREE_LAUNCH_AHEAD=0): the A/B of the early launch.
    "ddtree63to15-behind": _tree({"1": 63, "8": 15}, DDTREE_LAUNCH_AHEAD="0"),
    # Steady steps' trees built and laid out on the GPU, set explicitly (DDTREE_DEVICE_PLAN=1; the default does it
    # where the engine allows it): no host wait for the drafter's top-K, the build kernels on the GPU between the
    # drafter and the forward instead; and every step's trees built on the host (DDTREE_DEVICE_PLAN=0).
    "ddtree63to15-device-plan": _tree({"1": 63, "8": 15}, DDTREE_DEVICE_PLAN="1"),
    "ddtree63to15-host-plan": _tree({"1": 63, "8": 15}, DDTREE_DEVICE_PLAN="0"),
    # The released drafter's layer kinds too (four sliding-window layers of 2048 positions, one full;
    # DDTREE_SLIDING_DRAFTER=1, experimental): its windowed FlashAttention metadata under the engine's graphs.
    "ddtree63to15-sliding-drafter": dict(
        _tree({"1": 63, "8": 15}, DDTREE_SLIDING_DRAFTER="1"), drafter=SLIDING_DRAFTER_DIR
    ),
}


def write_models(root: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3_5Config

    text = dict(
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=VOCAB,
        attn_output_gate=True,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_value_head_dim=128,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        mamba_ssm_dtype="float32",
        eos_token_id=248044,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    target = os.path.join(root, "target")
    cfg = Qwen3_5Config(text_config=text)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.torch_dtype = "bfloat16"
    os.makedirs(target, exist_ok=True)
    cfg.save_pretrained(target)
    # A word-level tokenizer over the full vocabulary (vLLM's Qwen3.5 processor wants one).
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t248044", pad_token="t0").save_pretrained(target)
    drafter = os.path.join(root, "drafter")
    os.makedirs(drafter, exist_ok=True)
    with open(os.path.join(drafter, "config.json"), "w") as f:
        json.dump(
            dict(
                architectures=["DFlashDraftModel"],
                model_type="qwen3",
                hidden_size=5120,
                intermediate_size=17408,
                num_hidden_layers=5,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=VOCAB,
                rms_norm_eps=1e-6,
                rope_theta=1e7,
                max_position_embeddings=262144,
                torch_dtype="bfloat16",
                hidden_act="silu",
                block_size=16,
                num_target_layers=64,
                tie_word_embeddings=False,
                dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
            ),
            f,
            indent=1,
        )
    sliding = os.path.join(root, SLIDING_DRAFTER_DIR)
    os.makedirs(sliding, exist_ok=True)
    with open(os.path.join(drafter, "config.json")) as f:
        config = json.load(f)
    config.update(layer_types=RELEASED_LAYER_TYPES, sliding_window=2048, use_sliding_window=True)
    with open(os.path.join(sliding, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def state_memory(worker) -> dict:
    """Recurrent-state bytes a request holds, from the worker's KV-cache config (runs inside the worker)."""
    runner = worker.model_runner
    reserved = exact = layers = blocks = 0
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec).__name__ != "MambaSpec":
            continue
        per_block = 1 + spec.num_speculative_blocks
        blocks = per_block
        layers += len(group.layer_names)
        reserved += len(group.layer_names) * per_block * spec.page_size_bytes
        import math

        import torch

        state = sum(
            math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in zip(spec.shapes, spec.dtypes)
        )
        exact += len(group.layer_names) * per_block * state
    return {"gdn_layers": layers, "state_blocks_per_request": blocks, "reserved_bytes": reserved, "state_bytes": exact}


def partial_path(out: str, name: str) -> str:
    return os.path.join(out, f"engine_{name}.partial.json")


def write_partial(out: str, name: str, res: dict) -> None:
    """The engine's rows so far, written as soon as each exists (stdout is lost when the parent kills us)."""
    if out:
        with open(partial_path(out, name), "w") as f:
            json.dump(res, f, indent=1)


class RunningPeak:
    """The most requests vLLM's scheduler had running at once, read after each of its ``schedule`` calls (an
    in-process engine core; None elsewhere). A batch larger than the KV cache holds runs in waves: vLLM's chain on
    an 80 GB H100 held 3.84 requests of 4096 tokens at this shape (1 + 15 state slots a request) and ran batch 8 as
    two waves of 4, its "batch-8 step" twice a batch-4 step (``gpu-h100-27b-ab-chain-0cecefa``)."""

    def __init__(self, llm):
        self.scheduler = inprocess_scheduler(llm)
        self.peak: Optional[int] = None
        if self.scheduler is not None:
            schedule = self.scheduler.schedule

            def counted(*args, **kwargs):
                out = schedule(*args, **kwargs)
                self.peak = max(self.peak or 0, len(self.scheduler.running))
                return out

            self.scheduler.schedule = counted

    def reset(self) -> None:
        self.peak = None


def timed_generate(llm, prompts, max_tokens: int):
    """(seconds, outputs) of one greedy ``generate`` of ``max_tokens`` per prompt, the GPU drained on both sides."""
    import torch
    from vllm import SamplingParams

    torch.cuda.synchronize()
    started = time.time()
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    torch.cuda.synchronize()
    return time.time() - started, outs


def set_whole_tree_gdn_metadata(worker, on: bool) -> bool:
    """(collective_rpc) Turns patch 10 on or off in a worker; returns the previous setting."""
    from ddtree.vllm import gdn_metadata

    return gdn_metadata.set_active(on)


def set_device_accept(worker, on: bool) -> bool:
    """(collective_rpc) Walks the trees on the device (DDTREE_DEVICE_ACCEPT) or on the host; returns the previous
    setting."""
    runner = worker.model_runner
    _refuse_under_async(runner, "the device walk", on)
    previous, runner._ddtree_device_accept = runner._ddtree_device_accept, bool(on)
    return previous


def set_step_graphs(worker, on: bool) -> bool:
    """(collective_rpc) The device walk, the plan's device side and the KV moves of FULL steps through CUDA graphs
    (DDTREE_STEP_GRAPHS) or launch by launch; returns the previous setting."""
    runner = worker.model_runner
    previous, runner._ddtree_step_graphs_on = runner._ddtree_step_graphs_on, bool(on)
    return previous


def _refuse_under_async(runner, what: str, on: bool) -> None:
    if runner.use_async_scheduling and not on:
        raise RuntimeError(f"{what} cannot be turned off under asynchronous scheduling (the engine needs it)")


def set_late_trees(worker, on: bool) -> bool:
    """(collective_rpc) Builds the trees at the next verification (DDTREE_LATE_TREES) or at proposal; returns the
    previous setting."""
    runner = worker.model_runner
    _refuse_under_async(runner, "late trees", on)
    previous, runner._ddtree_late_trees = runner._ddtree_late_trees, bool(on)
    return previous


def set_launch_ahead(worker, on: bool) -> bool:
    """(collective_rpc) Queues eligible forwards ahead of their trees behind the stream gate (DDTREE_LAUNCH_AHEAD) or
    prepares every step before its forward; returns the previous setting. Off keeps the gate aside for the restore."""
    runner = worker.model_runner
    previous = runner._ddtree_gate is not None
    if on and not previous:
        runner._ddtree_gate, runner._ddtree_gate_aside = getattr(runner, "_ddtree_gate_aside", None), None
        if runner._ddtree_gate is None:
            raise RuntimeError("launch ahead cannot be turned on: the engine started without it (DDTREE_LAUNCH_AHEAD)")
    elif not on and previous:
        runner._ddtree_gate_aside, runner._ddtree_gate = runner._ddtree_gate, None
    return previous


def set_device_plan(worker, on: bool) -> bool:
    """(collective_rpc) Plans steady steps on the device (DDTREE_DEVICE_PLAN) or every step on the host; returns the
    previous setting. Off keeps the planner aside for the restore (the engine must start with the switch on: its
    planner and graphs are made at start-up)."""
    runner = worker.model_runner
    previous = runner._ddtree_device_planner is not None
    if on and not previous:
        runner._ddtree_device_planner = getattr(runner, "_ddtree_device_planner_aside", None)
        runner._ddtree_device_planner_aside = None
        if runner._ddtree_device_planner is None:
            raise RuntimeError(
                "the device plan cannot be turned on: the engine started without it (DDTREE_DEVICE_PLAN)"
            )
    elif not on and previous:
        runner._ddtree_device_planner_aside, runner._ddtree_device_planner = runner._ddtree_device_planner, None
    return previous


def set_commit_in_place(worker, on: bool) -> bool:
    """(collective_rpc) Commits a replayed walk's step with one graph reading the walk's outputs in place, the K/V
    moves in it (DDTREE_COMMIT_IN_PLACE), or from copies with the moves apart; returns the previous setting."""
    runner = worker.model_runner
    previous, runner._ddtree_commit_in_place = runner._ddtree_commit_in_place, bool(on)
    return previous


#: ``--ab NAME[,NAME...]``: each ddtree batch is timed once more in the same engine per NAME, the switches turned
#: one after the other and kept (the first timing has the engine's own settings): the setter and its setting.
AB_SWITCHES = {
    "gdn-metadata": (set_whole_tree_gdn_metadata, False),
    "device-accept": (set_device_accept, True),
    "late-trees": (set_late_trees, True),
    "no-late-trees": (set_late_trees, False),
    "no-device-accept": (set_device_accept, False),
    "no-step-graphs": (set_step_graphs, False),
    "no-launch-ahead": (set_launch_ahead, False),
    "commit-in-place": (set_commit_in_place, True),
    "device-plan": (set_device_plan, True),
    "no-device-plan": (set_device_plan, False),
    "no-commit-in-place": (set_commit_in_place, False),
}


def ab_timings(llm, prompts, ab: str, prefill_seconds: float, rounds: int = 1) -> list:
    """ms per decode step with each switch of ``ab`` turned in turn (cumulatively), then every switch restored and
    the engine's own settings timed once more (``"again": true``): later runs of one process tend to be faster (a
    warmer host), and this last row shows by how much, beside the first timing of the same settings. ``rounds``:
    the whole sequence that many times (each row says its ``round``), so that a difference of a few tenths of a ms
    between settings can be told from one run's spread."""
    rows = []
    names = ab.split(",")
    for round_ in range(rounds):
        restore = []
        try:
            for name in names:
                setter, setting = AB_SWITCHES[name]
                restore.append((setter, llm.collective_rpc(setter, args=(setting,))[0]))
                rows.append(dict(_switched_row(llm, prompts, prefill_seconds, names[: len(restore)]), round=round_))
        finally:
            for setter, previous in reversed(restore):
                llm.collective_rpc(setter, args=(previous,))
        rows.append(dict(_switched_row(llm, prompts, prefill_seconds, []), again=True, round=round_))
    return rows


def _switched_row(llm, prompts, prefill_seconds: float, switches: list) -> dict:
    """One A/B row: ms per decode step of a run with the engine as it is set now, and what that run did."""
    timed_generate(llm, prompts, 4)  # (untimed: graphs the switched path captures on its first steps)
    before = llm.collective_rpc("ddtree_summary")[0]
    switched, _ = timed_generate(llm, prompts, OUT_TOKENS)
    after = llm.collective_rpc("ddtree_summary")[0]
    ms = round(1e3 * (switched - prefill_seconds) / (OUT_TOKENS - 1), 2)
    row = {"switches": switches, "ms_per_decode_step": ms}
    # What the run did (a switch that did not take would show here, not only in a timing).
    counters = (
        "verify_steps",
        "early_launch_steps",
        "landed_before_launch_steps",
        "full_graph_steps",
        "device_plan_steps",
    )
    row.update(counter_deltas(before, after, (*counters, "commit_in_place_steps")))
    row.update(host_ms_fields(before, after, vllm_parts=False))  # (the A/B rows leave out vLLM's launch)
    return row


def run_engine(
    name: str,
    batches,
    tp: int = 1,
    profile_dir: str = "",
    profile_batches=(),
    eager=False,
    ab: str = "",
    profile_stacks: bool = True,
    gpu_memory_utilization: float = 0.85,
    ab_rounds: int = 1,
) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    # Triton's autotuning results kept on disk: an engine after the first skips autotuning vLLM's GDN kernels.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if profile_batches:
        enable_scopes()
    import torch
    from vllm import LLM, SamplingParams

    spec = dict(ENGINES[name]) if ENGINES[name] else None
    os.environ.update(spec.pop("env", {}) if spec else {})  # the engine runs in this process
    drafter_dir = spec.pop("drafter", "drafter") if spec else "drafter"
    kw = dict(
        model=os.path.join(ROOT, "target"),
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=4096,
        max_num_seqs=max(batches),
        seed=0,
        language_model_only=True,
        enforce_eager=eager,  # prefix caching at vLLM's default: off for this hybrid shape, on both sides
        additional_config={"gdn_prefill_backend": "triton"},
        tensor_parallel_size=tp,
    )
    if spec is not None:
        kw["speculative_config"] = dict(spec, model=os.path.join(ROOT, drafter_dir))
    t0 = time.time()
    llm = LLM(**kw)
    res = {
        "engine": name,
        "tensor_parallel_size": tp,
        "init_s": round(time.time() - t0, 1),
        "steps": {},
        "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
        # vLLM's chain overlaps scheduling with the GPU when this is on; ddtree turns it off.
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        # On with --profile-batches for the whole engine (vLLM reads it once): every timed row pays for the ranges.
        "profiling_scopes": scopes_on(),
    }
    cache = llm.llm_engine.vllm_config.cache_config
    res["kv_cache"] = {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    res["state_memory"] = llm.collective_rpc(state_memory)[0]
    write_partial(profile_dir, name, res)
    running = RunningPeak(llm)
    gen = torch.Generator().manual_seed(0)
    for bs in batches:
        prompts = [
            {"prompt_token_ids": torch.randint(1000, 200000, (PROMPT_LEN,), generator=gen).tolist()} for _ in range(bs)
        ]
        # Warm-up at this batch size: the first steps of a new batch size pay one-time costs (a ddtree engine's
        # GDN commit-graph capture among them; about 0.6 s at this shape), which must not land in the timed run
        # (they did in the batch-8 rows of ddtree engines with commit graphs in gpu-h200-27b-shape-7ec2cc3 and
        # -05fced2).
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        # The prompts' prefill alone (one token each; prefix caching is off, vLLM's default for hybrids, so the
        # timed run prefills again): subtracted from the timed run, it leaves the decode steps' cost.
        prefill_seconds, _ = timed_generate(llm, prompts, 1)
        before = llm.collective_rpc("ddtree_summary")[0] if name.startswith("ddtree") else None
        running.reset()
        seconds, outs = timed_generate(llm, prompts, OUT_TOKENS)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {
            "seconds": round(seconds, 3),
            "tokens": tokens,
            "ms_per_step": round(1e3 * seconds / OUT_TOKENS, 2),
            "prefill_seconds": round(prefill_seconds, 3),
            "ms_per_decode_step": round(1e3 * (seconds - prefill_seconds) / (OUT_TOKENS - 1), 2),
            "tokens_per_s": round(tokens / seconds, 1),
            # Fewer than the batch: the KV cache held only that many at once, and the batch ran in waves.
            "most_running": running.peak,
        }
        if before is not None:
            after = llm.collective_rpc("ddtree_summary")[0]
            steps = after["verify_steps"] - before["verify_steps"]
            row["verify_steps"] = steps
            row["mean_acceptance_length"] = after["mean_acceptance_length"]
            row.update(host_ms_fields(before, after))
            counters = (
                "full_graph_steps",
                "commit_graph_steps",
                "commit_in_place_steps",
                "graph_capture_failures",
                "walk_graph_steps",
                "walk_copied_steps",
                "device_accept_steps",
                "late_tree_steps",
                "early_launch_steps",
                "landed_before_launch_steps",
                "early_output_steps",
                "device_plan_steps",
                "whole_tree_gdn_metadata_builds",
                "step_graphs",
                "step_graph_reserved_mb",
            )
            row.update(counter_deltas(before, after, counters))
            by_tree, then = (
                after.get("full_graph_steps_by_tree_tokens", {}),
                before.get("full_graph_steps_by_tree_tokens", {}),
            )
            row["full_graph_steps_by_tree_tokens"] = {size: n - then.get(size, 0) for size, n in by_tree.items()}
        if ab and before is not None:
            # The same engine and prompts with switches turned: an A/B in one process, so the difference is the
            # switches' and not the host's or the run's.
            row["ab"] = ab_timings(llm, prompts, ab, prefill_seconds, ab_rounds)
        res["steps"][bs] = row
        print(f"{name} bs={bs}: {row}", flush=True)
        write_partial(profile_dir, name, res)  # the parent keeps these rows if a later batch runs out of time
        if bs in profile_batches:
            # 16 more steps under the profiler: per-kernel GPU time of one step's parts (drafter, GDN, attention).
            res.setdefault("profiles", {})[bs] = profile_generate(
                llm,
                prompts,
                SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                os.path.join(profile_dir, f"profile_{name}_tp{tp}_b{bs}.txt"),
                stacks=profile_stacks,
            )
    return res


def step_summary(row: dict, chain_row, batch: Optional[int] = None) -> str:
    """``ms/step (ms/decode step, x the chain's decode step)`` of one batch size; the ratio needs the chain's row
    of the same run. A row whose batch ran in waves (``most_running`` below ``batch``) says so, and so does a ratio
    to such a chain row: it is not a step against a step."""
    decode = row.get("ms_per_decode_step")
    ratio = ""
    if decode and chain_row and chain_row.get("ms_per_decode_step"):
        ratio = f", {decode / chain_row['ms_per_decode_step']:.2f}x"
        ratio += " the chain's waves" if in_waves(chain_row, batch) else ""
    waves = f" [in waves: {row['most_running']} of {batch} at once]" if in_waves(row, batch) else ""
    return f"{row['ms_per_step']} ({decode}{ratio}){waves}"


def in_waves(row: dict, batch: Optional[int]) -> bool:
    """Whether a row's batch ran in waves: fewer requests ran at once than the batch (unknown: no)."""
    most = row.get("most_running")
    return batch is not None and most is not None and most < int(batch)


def keep_partial(out: str, name: str, results: dict, how: str) -> None:
    """Keeps the rows an engine wrote before it timed out or died (marked ``how``: True) in the results file."""
    if not os.path.exists(partial_path(out, name)):
        return
    with open(partial_path(out, name)) as f:
        results[name] = dict(json.load(f), **{how: True})
    print(f"{name}: kept the batches written before it {how.replace('_', ' ')}: {sorted(results[name]['steps'])}")
    with open(os.path.join(out, "bench_qwen36_shape.json"), "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/qwen36_shape_out"))
    ap.add_argument("--engines", default="dflash,ddtree15,ddtree63,ddtree255")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--child", default=None)
    ap.add_argument(
        "--timeout",
        type=int,
        default=480,
        help="per engine; under CUDA graphs an engine's start (torch.compile, capture) took 200-240 s",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument(
        "--ab-rounds",
        type=int,
        default=1,
        help="with --ab: the whole sequence of switched rows (and the again row) this many times, in turn",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="vLLM's, every engine (0.85 left an H200 room; an 80 GB H100 holds the 54 GB of weights with ~0.92)",
    )
    ap.add_argument("--eager", action="store_true", help="every engine in eager mode (default: CUDA graphs)")
    ap.add_argument(
        "--profile-batches",
        default="",
        help="batch sizes to run 16 more steps of under torch.profiler (profile_<engine>_tp<tp>_b<B>.txt "
        "in --out; rank 0 only)",
    )
    ap.add_argument(
        "--profile-no-stacks",
        action="store_true",
        help="profiles without Python stacks (a much smaller timeline, written in seconds rather than a minute)",
    )
    ap.add_argument(
        "--ab",
        default="",
        help="comma-separated switches: ddtree engines time each batch once more per switch in the same process, "
        "the switches turned one after the other and kept: gdn-metadata (patch 10 off), device-accept / "
        "no-device-accept (the tree walk on the device / the host), late-trees / no-late-trees (trees built at the "
        "next verification / at proposal), no-step-graphs (the walk, plan and KV moves launch by launch instead of "
        "CUDA graphs), no-launch-ahead (every step prepared before its forward), commit-in-place / "
        "no-commit-in-place (a replayed walk's step committed by one graph reading its outputs in place, K/V moves "
        "included / from copies, moves apart); each row has ddtree's host ms per verify step of its own steps, and a "
        "last row (again) times the engine's own settings once more, after the switches are restored",
    )
    args = ap.parse_args()
    unknown = [name for name in args.ab.split(",") if name and name not in AB_SWITCHES]
    if unknown:
        ap.error(f"--ab: unknown switches {unknown}; known: {sorted(AB_SWITCHES)}")
    batches = [int(b) for b in args.batch.split(",")]
    if args.child:
        profile_batches = {int(b) for b in args.profile_batches.split(",") if b}
        result = run_engine(
            args.child,
            batches,
            args.tp,
            args.out,
            profile_batches,
            args.eager,
            args.ab,
            not args.profile_no_stacks,
            args.gpu_memory_utilization,
            args.ab_rounds,
        )
        print("RESULT-JSON " + json.dumps(result), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    write_models(ROOT)
    results = {}
    for name in args.engines.split(","):
        t = time.time()
        log_path = os.path.join(args.out, f"engine_{name}.log")
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--child",
                        name,
                        "--batch",
                        args.batch,
                        "--tp",
                        str(args.tp),
                        "--out",
                        args.out,
                        "--profile-batches",
                        args.profile_batches,
                        "--gpu-memory-utilization",
                        str(args.gpu_memory_utilization),
                        "--ab-rounds",
                        str(args.ab_rounds),
                    ]
                    + (["--profile-no-stacks"] if args.profile_no_stacks else [])
                    + (["--eager"] if args.eager else [])
                    + (["--ab", args.ab] if args.ab else []),
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    timeout=args.timeout,
                )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT-JSON ")), None)
            if line is None:
                print(f"{name}: no result (rc {proc.returncode}); log tail:\n{open(log_path).read()[-3000:]}")
                keep_partial(args.out, name, results, "failed")
                continue
            results[name] = json.loads(line[len("RESULT-JSON ") :])
            print(f"{name}: done in {time.time() - t:.0f} s", flush=True)
            with open(os.path.join(args.out, "bench_qwen36_shape.json"), "w") as f:  # kept if a later engine hangs
                json.dump(results, f, indent=1)
        except subprocess.TimeoutExpired:
            print(f"{name}: TIMEOUT after {args.timeout} s; log tail:\n{open(log_path).read()[-3000:]}", flush=True)
            keep_partial(args.out, name, results, "timed_out")
    with open(os.path.join(args.out, "bench_qwen36_shape.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(
        f"{'engine':<11}{'state MB/req':>13}{'blocks':>7}{'KV blocks':>10}  "
        "ms/step (ms/decode step, x the chain's) by batch   host ms/step"
    )
    chain = results.get("dflash", {}).get("steps", {})
    for name, res in results.items():
        mem = res["state_memory"]
        steps = "  ".join(f"bs{bs}: {step_summary(row, chain.get(bs), bs)}" for bs, row in res["steps"].items())
        host = {bs: row.get("host_ms_per_verify_step") for bs, row in res["steps"].items()}
        print(
            f"{name:<11}{mem['reserved_bytes'] / 2**20:>13.1f}{mem['state_blocks_per_request']:>7}"
            f"{res['kv_cache']['num_gpu_blocks']:>10}  {steps}   {host}"
        )
    print_family_comparisons(results)


def print_family_comparisons(results: dict) -> None:
    """For every ddtree engine and batch size profiled beside vLLM's chain in this run: GPU time by kernel family
    (per output token: one step, the dummy drafter never being accepted), ddtree against the chain."""
    chain = results.get("dflash", {}).get("profiles", {})
    for name, res in results.items():
        if name == "dflash":
            continue
        for bs, profile in res.get("profiles", {}).items():
            theirs = chain.get(bs, {}).get("gpu_ms_per_token_by_kernel_family")
            mine = profile.get("gpu_ms_per_token_by_kernel_family")
            if mine and theirs:
                print(f"\nGPU ms per step by kernel family, {name} against dflash, batch {bs} (profiled):")
                print(family_comparison(mine, theirs), end="")


if __name__ == "__main__":
    main()
