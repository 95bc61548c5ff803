"""Throughput and acceptance of vLLM 0.25.x: no speculation vs vLLM's DFlash vs DDTree (GPU).

    python benches/bench_vllm_ddtree.py [--model PAIR_DIR | --target DIR --drafter DIR [--prompts FILE]]
                                        [--budgets 15,31,63,127,255]
                                        [--batches 1,8,32] [--max-tokens 128] [--out DIR] [--eager]

``--model DIR`` is a pair's directory as ``tests/fixtures/models`` lays it out (``target/``, ``drafter/``,
``prompts.json``): the trained pair of every recorded run. Without it or --target/--drafter it writes the tiny
random Qwen3 target and DFlash
drafter of ``ddtree.vllm.tiny_models`` (random drafter: acceptance near zero
except where DDTree's top-K covers the tiny vocabulary). ``--prompts`` takes a
JSON file ``{"batch32": [[token ids], ...]}`` (e.g. a trained pair's held-out
prompts, cycled to ``--requests``) instead of random token prompts. Each engine runs in
its own subprocess, under CUDA graphs as vLLM runs by default (``--eager``: every engine eager); each
engine's rows are written to ``bench_vllm_ddtree.json`` as soon as that engine finishes (a run cut short
keeps them), and one table is printed at the end:

    engine  batch  tokens/s  mean acceptance length  ms/step  host ms/step  of it in ddtree's graph launches
    (greedy, ignore_eos, token-id prompts)

Each row: a warm-up ``generate`` at that batch size (the first b requests as the timed runs serve them: every step
shape the runs meet, ddtree's step-graph captures left there and counted, ``warmup_first_runs``), then ``--repeats``
timed runs of the same ``--requests`` requests (default 32), served b at a time (batch 1: 32 one-request runs), the
fastest run reported.
``--profile-batches 8`` adds a torch.profiler table per engine and batch (``profile_<engine>_b8.txt``), taken after
every timed run of that engine (the profiler leaves the process slower).
``--interleave`` (with ``--concurrent-starts`` at least the engines' number) takes the timed runs in rounds, each
round one run of every engine (``engine_turns``): the host's drift then falls on every engine alike, and the table adds
each engine's ratio to the chain run by run, the median over rounds (``ratio_to_dflash_by_round``; use
``--repeats`` 3 or more for it to be a median).

Mean acceptance length = 1 + accepted / drafts from vLLM's own spec-decode
counters (for DDTree a "draft" is one verified tree).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import engine_turns
import thread_cpu
from engine_turns import (
    engine_arguments,
    kv_cache_kwargs,
    memory_share,
    new_gate,
    round_name,
    run_in_turns,
    wait_for_turn,
)
from gpu_profile import (
    GRAPH_LAUNCH_MS,
    HOST_DETAIL_MS,
    counter_deltas,
    enable_scopes,
    first_run_steps,
    host_ms_fields,
    inprocess_scheduler,
    profile_generate,
    scopes_on,
)


def child(args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(args.spec) if args.spec else None
    max_batch = max(int(b) for b in args.batches.split(","))
    budget = largest_budget(spec)
    graph_mode = spec.pop("cudagraph_mode", None) if spec else None
    os.environ.update(spec.pop("env", {}) if spec else {})  # e.g. DDTREE_COMMIT_GRAPHS (the engine is in-process)
    kw = dict(
        model=args.target,
        skip_tokenizer_init=not args.regex,  # (structured outputs need the tokenizer; prompts stay token ids)
        dtype="bfloat16",
        enforce_eager=args.eager,
        max_model_len=args.max_model_len,
        max_num_seqs=max_batch,
        seed=0,
        disable_log_stats=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        # Prefix caching at vLLM's default on both sides (off for hybrid targets such as the pair's, on for
        # attention-only ones): both as users run them; with it on, a repeat's prompts hit the cache on both sides.
        # --prefix-caching turns it on for every engine (a hybrid's through vLLM's mamba cache mode "align").
        max_num_batched_tokens=max(8192, max_batch * (budget + args.draft_len) + args.prompt_len),
        **({"enable_prefix_caching": True} if args.prefix_caching else {}),
    )
    if spec is not None:
        kw["speculative_config"] = dict(spec, model=args.drafter)
    if graph_mode is not None and not args.eager:
        kw["compilation_config"] = {"cudagraph_mode": graph_mode}
    from ddtree.vllm.tiny_models import engine_kwargs_for

    kw.update(engine_kwargs_for(args.target), **kv_cache_kwargs(args.kv_cache_gib))
    if args.profile_batches:
        enable_scopes()
    started = time.time()
    llm = LLM(**kw)
    init_s = time.time() - started
    if args.gate:
        wait_for_turn(args.gate, args.name)
    given = None
    if args.prompts:
        with open(args.prompts) as f:
            given = json.load(f)["batch32"]
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rnd = random.Random(0)

    from ddtree.vllm.tiny_models import spec_metrics

    rows = []
    first_groups = {}  # batch size -> the requests of its first group (what a profile of that size serves)
    turns = 0  # --interleave: the rounds this engine has been given beyond its first (one per timed run)

    def next_turn():
        nonlocal turns
        turns += 1
        if args.gate and args.interleave:
            wait_for_turn(args.gate, round_name(args.name, turns))

    for index, b in enumerate(int(x) for x in args.batches.split(",")):
        if index:
            next_turn()
        # Every batch size serves the same requests (``--requests``, the given prompts in order), b at a time:
        # batch 1 is as many one-request runs, not one request (a single 128-token request is ~40 steps, where one
        # scheduling hiccup moves the figure by tens of percent).
        if given:
            all_prompts = [TokensPrompt(prompt_token_ids=list(given[i % len(given)])) for i in range(args.requests)]
        else:
            all_prompts = [
                TokensPrompt(prompt_token_ids=[rnd.randrange(2, vocab - 1) for _ in range(args.prompt_len)])
                for _ in range(args.requests)
            ]
        groups = [all_prompts[i : i + b] for i in range(0, len(all_prompts), b)]
        if args.churn:  # every request at once, at most b running: they end and join all the time
            groups = [all_prompts]
            limit_running_requests(llm, b)
        prompts = groups[0]
        params = timed_params(args)
        is_tree = spec is not None and spec.get("method") == "ddtree"
        if is_tree and args.host_pieces:
            llm.collective_rpc("ddtree_host_pieces", args=(True,))  # (before the warm-up: its steps are timed too)
        warm_start = llm.collective_rpc("ddtree_summary")[0] if is_tree else None
        # Warm-up at this batch size: the first group as the timed runs serve it. Triton kernels specialise on
        # shapes, and ddtree captures a step graph the first time it meets a step shape (a batch shrinking request
        # by request meets one per size: a 16-token warm-up, where every request ends at once, met one, and
        # ddtree's first timed run at batch 32 took 1.6-2.0x its later ones, gpu-h200-pair-2b9ceeb). The warm-up's
        # first runs are reported (``warmup_first_runs``): users pay them once per shape.
        llm.generate(prompts, params[: len(prompts)] if isinstance(params, list) else params, use_tqdm=False)
        best = None
        seconds_by_repeat = []  # every timed run's, in round order (the parent's per-round ratios)
        thread_seconds = {}  # CPU seconds by thread of this process tree over the timed runs (thread_cpu)
        window_start = llm.collective_rpc("ddtree_summary")[0] if is_tree else None
        for repeat in range(args.repeats):
            if repeat:
                next_turn()
            before = spec_metrics(llm)
            threads_before = thread_cpu.snapshot()
            dt, outs = 0.0, []
            for g, group in enumerate(groups):
                own = params[g * b : g * b + len(group)] if isinstance(params, list) else params
                t = time.time()
                outs += llm.generate(group, own, use_tqdm=False)
                dt += time.time() - t
            after = spec_metrics(llm)
            threads_after = thread_cpu.snapshot()
            for key, seconds in threads_after.items():  # every repeat's CPU seconds, by thread
                thread_seconds[key] = thread_seconds.get(key, 0.0) + seconds - threads_before.get(key, 0.0)
            seconds_by_repeat.append(dt)
            if best is None or dt < best[0]:
                best = (dt, outs, before, after)
        dt, outs, before, after = best
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        drafts = after["drafts"] - before["drafts"]
        mal = 1.0 + (after["accepted"] - before["accepted"]) / drafts if drafts else None
        # Steps of the slowest request: with equal max_tokens every request needs about tokens / b / mal steps.
        steps = tokens / b / (mal or 1.0)
        row = {
            "batch": b,
            "tokens_per_s": tokens / dt,
            "mean_acceptance_length": mal,
            "seconds": dt,
            "ms_per_step": 1000.0 * dt / steps,
            "repeats": args.repeats,
            "seconds_by_repeat": seconds_by_repeat,
            "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
            "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
            "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
            "churn": bool(args.churn),  # every request at once, at most b running, lengths of their own
            "profiling_scopes": scopes_on(),  # on with --profile-batches: the timed runs pay for vLLM's ranges
            "engine_start_s": round(init_s, 1),
            # Which threads of the engine's processes were busy over all timed runs (seconds of wall: sum of
            # seconds_by_repeat): a thread busy beside the main one slows it (gpu-h200-pair-cad0d30's profiles).
            "thread_cpu_s": thread_cpu.busiest({}, thread_seconds),
        }
        if is_tree:
            summary = llm.collective_rpc("ddtree_summary")[0]
            # Host work per steady verify step over the timed repeats (the warm-up's one-time costs left out, and
            # the timed steps that ran a graph shape for the first time counted apart), of it the graph launches
            # (waits for room in a full launch queue included).
            row.update(host_ms_fields(window_start, summary))
            # The warm-up's first runs (warmup_first_runs, warmup_host_ms_per_first_run).
            row.update(("warmup_" + k, v) for k, v in first_run_steps(warm_start, window_start).items())
            row["verify_steps"], row["full_graph_steps"] = summary["verify_steps"], summary["full_graph_steps"]
            row["commit_graph_steps"] = summary.get("commit_graph_steps", 0)
            row["commit_in_place_steps"] = summary.get("commit_in_place_steps", 0)
            # Step graphs whose capture ran out of memory (their shapes then ran launch by launch: slower).
            row["graph_capture_failures"] = summary.get("graph_capture_failures", 0)
            # Device-walked steps the statistics left out (their ring slot held another step's paths): 0 expected.
            row["stats_lost_steps"] = summary.get("stats_lost_steps", 0)
            # Engine life so far: ddtree's step graphs and the device memory their captures reserved.
            row["step_graphs"] = summary.get("step_graphs", 0)
            row["step_graph_reserved_mb"] = summary.get("step_graph_reserved_mb", 0.0)
            # Walks by a graph, and of those, by one that copied its trees in (they were not where it reads).
            row["walk_graph_steps"] = summary.get("walk_graph_steps", 0)
            row["walk_copied_steps"] = summary.get("walk_copied_steps", 0)
            # ... of them, walks whose node tokens the sampler wrote where the graph reads them (no copy launched).
            row["walk_target_in_place_steps"] = summary.get("walk_target_in_place_steps", 0)
            # Engine life so far: steps whose forward was queued before their trees (DDTREE_LAUNCH_AHEAD).
            row["early_launch_steps"] = summary.get("early_launch_steps", 0)
            row["landed_before_launch_steps"] = summary.get("landed_before_launch_steps", 0)
            # Engine life so far: steps planned on the device (DDTREE_DEVICE_PLAN), and of those the ones that
            # uploaded nothing (gpu-h200-device-plan-9e8b443's rows could not say how many there were).
            row["device_plan_steps"] = summary.get("device_plan_steps", 0)
            row["device_plan_resumed_steps"] = summary.get("device_plan_resumed_steps", 0)
            # The same over the timed runs alone, with the subset steps (DDTREE_DEVICE_PLAN_SUBSETS): how much of the
            # traffic the device plan served (--churn's requests end and join all the time).
            row["timed_runs"] = timed_window_counts(
                window_start,
                summary,
                (
                    "verify_steps",
                    "full_graph_steps",
                    "device_plan_steps",
                    "device_plan_subset_steps",
                    "prefill_beside_trees_steps",
                    "mixed_walk_graph_steps",
                    "walk_target_in_place_steps",
                    "landed_before_launch_steps",
                ),
            )
            # What smaller budgets and vLLM's DFlash chain would have accepted on the same trees (engine life so
            # far, warm-ups included): the chain's figure beside the dflash engine's own measured one.
            row["acceptance_length_if_budget"] = summary.get("acceptance_length_if_budget", {})
            row["acceptance_length_if_chain"] = summary.get("acceptance_length_if_chain", {})
            row["steps_by_budget"] = summary.get("steps_by_budget", {})
            if "auto_budget" in summary:  # ddtree_budget "auto": its choice so far and what it rests on
                row["auto_budget"] = summary["auto_budget"]
        if is_tree and args.host_profile:
            row["host_profile"] = host_profile_run(llm, groups, params, b, args)
        rows.append(row)
        # The greedy outputs, so engines can be compared token by token (tests/gpu/compare_outputs.py).
        with open(os.path.join(args.out, f"outputs_{args.name}_b{b}.json"), "w") as f:
            json.dump([list(o.outputs[0].token_ids) for o in outs], f)
        first_groups[b] = prompts
        with open(partial_rows_path(args.out, args.name), "w") as f:  # what the parent keeps if this engine dies
            json.dump(rows, f)
    # Profiles after every timed run, in a turn of their own: torch.profiler leaves the process slower (a profile
    # of batch 1 taken between the timed runs doubled every ddtree host counter of the batch-8 rows after it,
    # ``gpu-h200-pair-profile-77cb2e6``), and it must not run beside another engine's timed run.
    profiled_sizes = profiled_batches(args)
    if profiled_sizes:
        next_turn()
    for b in profiled_sizes:
        profiled = SamplingParams(
            temperature=0.0, max_tokens=args.profile_tokens or args.max_tokens, ignore_eos=True, detokenize=False
        )
        row = next(r for r in rows if r["batch"] == b)
        row["profile"] = profile_generate(
            llm,
            first_groups[b],
            profiled,
            os.path.join(args.out, f"profile_{args.name}_b{b}.txt"),
            stacks=not args.profile_no_stacks,
        )
        with open(partial_rows_path(args.out, args.name), "w") as f:
            json.dump(rows, f)
    print("RESULT-JSON " + json.dumps(rows), flush=True)


def timed_window_counts(before: dict, after: dict, names) -> dict:
    """``{name: after - before}`` of the summary counters ``names`` (absent: 0), and, when both are there,
    ``device_plan_share``: device-planned verify steps over all of them."""
    counts = counter_deltas(before, after, names)
    if counts.get("verify_steps") and "device_plan_steps" in counts:
        counts["device_plan_share"] = round(counts["device_plan_steps"] / counts["verify_steps"], 4)
    # Why the device plan turned the others down (the host planned them), by reason.
    declined = counter_deltas(
        before.get("device_plan_declined_steps", {}),
        after.get("device_plan_declined_steps", {}),
        after.get("device_plan_declined_steps", {}),
    )
    if any(declined.values()):
        counts["device_plan_declined_steps"] = {reason: n for reason, n in declined.items() if n}
    return counts


def host_profile_run(llm, groups, params, b: int, args) -> str:
    """One more run of the timed requests with ddtree's timed host work under cProfile (in this engine's turn,
    after its timed runs, which it would slow); writes and returns the file name of the profile's text."""
    llm.collective_rpc("ddtree_host_profile_start")
    for g, group in enumerate(groups):
        llm.generate(group, params[g * b : g * b + len(group)] if isinstance(params, list) else params, use_tqdm=False)
    text = llm.collective_rpc("ddtree_host_profile_stop")[0]
    name = f"host_profile_{args.name}_b{b}.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text)
    return name


def partial_rows_path(out: str, name: str) -> str:
    return os.path.join(out, f"rows_{name}.json")


def largest_budget(spec) -> int:
    """The most draft tokens an engine's step schedules per request: a budget, a schedule's largest, ``auto``'s
    maximum (default 64), or the chain's length (0 without speculation)."""
    if not spec:
        return 0
    budget = spec.get("ddtree_budget", spec.get("num_speculative_tokens", 0))
    if isinstance(budget, dict):
        return max(int(b) for b in budget.values())
    if budget == "auto":
        return int(spec.get("ddtree_max_budget", 64))
    return int(budget)


def pair_models(ap: argparse.ArgumentParser, args) -> None:
    """``--model DIR``: the target, drafter and prompts of the pair laid out in ``DIR`` (refused with another of
    --target/--drafter/--prompts, or where one of the three is missing)."""
    given = [flag for flag in ("target", "drafter", "prompts") if getattr(args, flag)]
    if given:
        ap.error(f"--model sets the pair's target, drafter and prompts: drop --{', --'.join(given)}")
    root = Path(args.model)
    args.target, args.drafter, args.prompts = str(root / "target"), str(root / "drafter"), str(root / "prompts.json")
    missing = [path for path in (args.target, args.drafter, args.prompts) if not os.path.exists(path)]
    if missing:
        ap.error(f"--model {args.model}: not a pair's directory, missing {', '.join(missing)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a pair's directory (target/, drafter/, prompts.json), e.g. tests/fixtures/models")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument(
        "--random-models",
        action="store_true",
        help="tiny random models in place of a pair: step costs only (their trees are never accepted)",
    )
    ap.add_argument("--prompts", default=None, help="JSON file with a 'batch32' list of token-id prompts")
    ap.add_argument("--budgets", default="15,31,63,127,255")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests each batch size serves, b at a time (default 32: every prompt of the pair's held-out set)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="of the timed runs and their warm-ups (default 0: greedy)"
    )
    ap.add_argument(
        "--seeded", action="store_true", help="with --temperature: request i of a run has seed i (seeded sampling)"
    )
    ap.add_argument(
        "--regex",
        default=None,
        help="structured outputs: every timed request under this regex (the pair's tokenizer loaded; ddtree engines "
        "with DDTREE_STRUCTURED_OUTPUTS=1); one that outlasts --max-tokens, e.g. '([a-z]+ ){400}', keeps the "
        "grammar on for every token",
    )
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="every engine with prefix caching on (a hybrid target's in vLLM's mamba cache mode \"align\", ddtree "
        "engines with DDTREE_HYBRID_PREFIX_CACHING=1); a repeat's prompts then hit the cache on every side (vLLM "
        "0.25.1's own chain may read K/V past its hit there: vllm-project/vllm#48375)",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--draft-len", type=int, default=15)
    ap.add_argument(
        "--schedule",
        type=json.loads,
        default=None,
        help='a budget schedule as JSON, e.g. \'{"1": 256, "8": 64}\': adds the engine "ddtree-schedule" (and '
        '"ddtree-schedule-async", run when named in --engines)',
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true", help="every engine in eager mode (default: CUDA graphs)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per engine for its start, and again for its runs")
    engine_turns.add_arguments(ap)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row; the fastest is reported")
    ap.add_argument(
        "--profile-batches", default="", help="batch sizes to run once more under torch.profiler (tables in --out)"
    )
    ap.add_argument(
        "--profile-tokens", type=int, default=0, help="new tokens per profiled request (default --max-tokens)"
    )
    ap.add_argument(
        "--profile-no-stacks", action="store_true", help="profiles without Python stacks (a much smaller timeline)"
    )
    ap.add_argument(
        "--churn",
        action="store_true",
        help="each request its own max_tokens, drawn from [max_tokens / 4, 7 max_tokens / 4] by its index, and each "
        "batch size b's run submits every request at once with at most b running (vLLM admits the next as one "
        "ends): requests end and join all the time, as in served traffic, where the default serves b at a time in "
        "lockstep",
    )
    ap.add_argument(
        "--host-pieces",
        action="store_true",
        help="ddtree engines: time the pieces inside each host part too (host_detail_ms_per_verify_step, printed "
        "part by part; ~0.7 us a piece on a development CPU, ten a step, so off by default to keep the host ms "
        "comparable with earlier rows)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="ddtree engines: after each batch size's timed runs, one more run with ddtree's timed host work under "
        "cProfile (host_profile_<engine>_b<B>.txt: functions by their own time; slowed by the profiler, so no row "
        "reads it)",
    )
    ap.add_argument(
        "--engines",
        default="",
        help="comma-separated engine names, run in that order (default: none, "
        "dflash and ddtree-B for every budget; ddtree-B-piecewise: PIECEWISE graphs only; ddtree-B-layercommit: "
        "DDTREE_COMMIT_GRAPHS=0, the GDN commit layer by layer; ddtree-B-host: the tree walk on the host and trees "
        "built at proposal; ddtree-B-device: the walk on the device, trees built at proposal; ddtree-B-late: both "
        "on, synchronous scheduling; ddtree-B-async: under vLLM's asynchronous scheduling, the TP-1 default, set "
        "explicitly; ddtree-B-behind: the forward queued after the trees are built, DDTREE_LAUNCH_AHEAD=0; "
        "ddtree-B-lazy: DDTREE_PRECAPTURE=0, the step graphs captured at each size's first step, not at start-up; "
        "ddtree-B-topk-graphs: DDTREE_TOPK_GRAPHS=1, the drafter's top-K as CUDA graphs; "
        "ddtree-B-precapture-all: DDTREE_PRECAPTURE=all, the commit's graphs at start-up too; "
        "ddtree-B-device-plan: DDTREE_DEVICE_PLAN=1, steady steps' trees built and laid out on the GPU (the "
        "default where the engine allows it), set explicitly; ddtree-B-host-plan: DDTREE_DEVICE_PLAN=0, every "
        "step's trees built on the host; ddtree-B-no-subsets: DDTREE_DEVICE_PLAN_SUBSETS=0, the step after a "
        "request ends planned on the host (the default plans it on the device); ddtree-B-mixed-walk: "
        "DDTREE_MIXED_WALK_GRAPHS=1, a step with a prefill beside its trees walked by a graph too (the default), "
        "set explicitly; ddtree-B-op-walk: DDTREE_MIXED_WALK_GRAPHS=0, such a step walked op by op; "
        "ddtree-auto: budget \"auto\" up to the largest of --budgets; ddtree-auto-late: the same, synchronous)",
    )
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ddtree_bench_out"))
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    largest_batch = max(int(b) for b in args.batches.split(","))
    if args.requests < largest_batch:
        ap.error(f"--requests {args.requests} cannot fill batch {largest_batch}: give at least {largest_batch}")

    if args.model:
        pair_models(ap, args)
    if not args.target and not args.random_models:
        # (A run without models once timed random ones where the pair was meant: gpu-h200-device-plan-c4ff208.)
        ap.error(
            "name the models: --model tests/fixtures/models (the trained pair), --target and --drafter, or "
            "--random-models (step costs only: a random drafter's trees are never accepted)"
        )
    if not args.target:
        from ddtree.vllm.tiny_models import write_drafter, write_target

        print("models: RANDOM tiny target and drafter (no --model or --target/--drafter): acceptance means nothing")

        args.target, args.drafter = "/tmp/ddtree_bench/target", "/tmp/ddtree_bench/drafter"
        spec = write_target(args.target)
        write_drafter(args.drafter, spec)
    os.makedirs(args.out, exist_ok=True)
    engines = [("none", None), ("dflash", {"method": "dflash", "num_speculative_tokens": args.draft_len})]
    default_engines = ["none", "dflash"] + [f"ddtree-{b}" for b in args.budgets.split(",")]
    # Synchronous scheduling with the device walk and late trees (the asynchronous default's own parts).
    late = {"DDTREE_DEVICE_ACCEPT": "1", "DDTREE_LATE_TREES": "1", "DDTREE_ASYNC_SCHEDULING": "0"}
    for b in (int(x) for x in args.budgets.split(",")):
        tree = {"method": "ddtree", "num_speculative_tokens": args.draft_len, "ddtree_budget": b}
        engines.append((f"ddtree-{b}", tree))
        # The same engine with PIECEWISE graphs only (tree steps' attention and GDN run eagerly between pieces).
        engines.append((f"ddtree-{b}-piecewise", dict(tree, cudagraph_mode="PIECEWISE")))
        # The same engine without the GDN commit graphs (the commit layer by layer, two launches per GDN layer).
        engines.append((f"ddtree-{b}-layercommit", dict(tree, env={"DDTREE_COMMIT_GRAPHS": "0"})))
        # The TP-1 defaults one by one: the host walk and trees built at proposal, the device walk alone, both.
        host = {"DDTREE_DEVICE_ACCEPT": "0", "DDTREE_LATE_TREES": "0"}
        engines.append((f"ddtree-{b}-host", dict(tree, env=host)))
        engines.append((f"ddtree-{b}-device", dict(tree, env=dict(host, DDTREE_DEVICE_ACCEPT="1"))))
        engines.append((f"ddtree-{b}-late", dict(tree, env=late)))
        # vLLM's asynchronous scheduling (DDTREE_ASYNC_SCHEDULING=1: the TP-1 default, set explicitly).
        engines.append((f"ddtree-{b}-async", dict(tree, env={"DDTREE_ASYNC_SCHEDULING": "1"})))
        # ... with each forward queued after its trees are built (DDTREE_LAUNCH_AHEAD=0; the default queues it first).
        engines.append((f"ddtree-{b}-behind", dict(tree, env={"DDTREE_LAUNCH_AHEAD": "0"})))
        # ... with the step graphs captured at each size's first step, not at start-up (DDTREE_PRECAPTURE=0).
        engines.append((f"ddtree-{b}-lazy", dict(tree, env={"DDTREE_PRECAPTURE": "0"})))
        # ... with the commit's graphs captured at start-up too (DDTREE_PRECAPTURE=all, experimental).
        engines.append((f"ddtree-{b}-precapture-all", dict(tree, env={"DDTREE_PRECAPTURE": "all"})))
        # ... with the drafter's top-K replayed as CUDA graphs (DDTREE_TOPK_GRAPHS=1, experimental).
        engines.append((f"ddtree-{b}-topk-graphs", dict(tree, env={"DDTREE_TOPK_GRAPHS": "1"})))
        # ... with steady steps' trees built and laid out on the GPU, set explicitly (the default does it where the
        # engine allows it), and with every step's trees built on the host (DDTREE_DEVICE_PLAN=0).
        engines.append((f"ddtree-{b}-device-plan", dict(tree, env={"DDTREE_DEVICE_PLAN": "1"})))
        engines.append((f"ddtree-{b}-host-plan", dict(tree, env={"DDTREE_DEVICE_PLAN": "0"})))
        # ... and with the step after a request ends left to the host plan (the default plans it on the device).
        engines.append((f"ddtree-{b}-no-subsets", dict(tree, env={"DDTREE_DEVICE_PLAN_SUBSETS": "0"})))
        # ... and with the walk of a step with a prefill beside its trees as a graph too, set explicitly (the
        # default since gpu-h100-e2e-arrivals-b5124aa), and op by op (DDTREE_MIXED_WALK_GRAPHS=0).
        engines.append((f"ddtree-{b}-mixed-walk", dict(tree, env={"DDTREE_MIXED_WALK_GRAPHS": "1"})))
        engines.append((f"ddtree-{b}-op-walk", dict(tree, env={"DDTREE_MIXED_WALK_GRAPHS": "0"})))
    # ddtree_budget "auto" up to the largest budget asked for (each batch size's budget chosen live).
    largest = max(int(b) for b in args.budgets.split(","))
    auto = {"method": "ddtree", "num_speculative_tokens": args.draft_len, "ddtree_budget": "auto"}
    engines.append(("ddtree-auto", dict(auto, ddtree_max_budget=largest)))
    default_engines.append("ddtree-auto")
    # The same under synchronous scheduling (its proposals, not vLLM's scheduler, follow the live choice).
    engines.append(("ddtree-auto-late", dict(auto, ddtree_max_budget=largest, env=late)))
    if args.schedule is not None:
        engines.append(
            (
                "ddtree-schedule",
                {"method": "ddtree", "num_speculative_tokens": args.draft_len, "ddtree_budget": args.schedule},
            )
        )
        default_engines.append("ddtree-schedule")
        # The schedule under vLLM's asynchronous scheduling (its scheduler places each step's budget in drafts).
        engines.append(("ddtree-schedule-async", dict(engines[-1][1], env={"DDTREE_ASYNC_SCHEDULING": "1"})))
    wanted = args.engines.split(",") if args.engines else default_engines
    known = dict(engines)
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; known: {list(known)}")
    engines = [(name, known[name]) for name in wanted]  # in the order given
    if args.interleave and args.concurrent_starts < len(engines):
        ap.error(
            f"--interleave keeps every engine resident: --concurrent-starts {args.concurrent_starts} < {len(engines)}"
        )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0", PYTHONUNBUFFERED="1")
    # Triton keeps its autotuning results on disk, so an engine after the first skips the autotuning of vLLM's GDN
    # kernels (each engine's profiling run took 74-81 s on an H200, for dflash as for ddtree).
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if args.regex:
        env["DDTREE_STRUCTURED_OUTPUTS"] = "1"  # (experimental, off by default; vLLM's chain serves them anyway)
    if args.prefix_caching:
        env["DDTREE_HYBRID_PREFIX_CACHING"] = "1"  # (experimental; attention-only targets cache without it)
    table = run_engines(args, engines, env)
    chain = {row["batch"]: row["tokens_per_s"] for row in table if row["engine"] == "dflash"}
    if args.interleave:
        add_round_ratios(table)
    print(
        f"\n{'engine':<14}{'batch':>6}{'tokens/s':>12}{'x dflash':>10}{'by round':>10}{'mean acc len':>14}"
        f"{'ms/step':>10}{'host ms':>9}{'launches':>10}{'first runs':>12}"
    )
    for row in table:
        mal = row["mean_acceptance_length"]
        ratio = row["tokens_per_s"] / chain[row["batch"]] if row["batch"] in chain else None
        by_round = row.get("ratio_to_dflash_by_round")
        host = sum(row.get("host_ms_per_verify_step", {}).values()) if "host_ms_per_verify_step" in row else None
        launches = sum(row.get(GRAPH_LAUNCH_MS, {}).values()) if GRAPH_LAUNCH_MS in row else None
        print(
            f"{row['engine']:<14}{row['batch']:>6}{row['tokens_per_s']:>12.1f}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>10}{(f'{by_round:.2f}' if by_round else '-'):>10}"
            f"{(f'{mal:.3f}' if mal else '-'):>14}"
            f"{row['ms_per_step']:>10.2f}{(f'{host:.2f}' if host is not None else '-'):>9}"
            f"{(f'{launches:.2f}' if launches is not None else '-'):>10}{row.get('first_runs', '-'):>12}"
        )
    pieces = host_pieces(table)
    if pieces:
        print("\nddtree's host ms a verify step, by part and the pieces measured inside it:")
        for line in pieces:
            print("  " + line)
    busy = busiest_threads(table)
    if busy:
        print("\nBusiest threads over each row's timed runs, CPU s (wall s):")
        for line in busy:
            print("  " + line)
    checks = what_if_chain_checks(table)
    if checks:
        print("\nThe chain's acceptance length as ddtree's trees estimate it, against vLLM's dflash in this run:")
        for engine, batch, estimate, measured in checks:
            print(f"  {engine} batch {batch}: {estimate:.3f} estimated, {measured:.3f} measured")
    json.dump(table, open(os.path.join(args.out, "bench_vllm_ddtree.json"), "w"), indent=1)


def host_pieces(rows) -> list:
    """One line per ddtree row: each host part's ms a verify step, then the pieces timed inside it
    (``host_detail_ms_per_verify_step``: "plan: device upload" is a piece of "plan"), largest first."""
    lines = []
    for row in rows:
        parts, pieces = row.get("host_ms_per_verify_step"), row.get(HOST_DETAIL_MS)
        if not parts:
            continue
        text = []
        for part, ms in sorted(parts.items(), key=lambda item: -item[1]):
            inside = sorted(
                ((name.split(": ", 1)[1], v) for name, v in (pieces or {}).items() if name.startswith(part + ": ")),
                key=lambda item: -item[1],
            )
            detail = f" ({', '.join(f'{name} {v:.3f}' for name, v in inside)})" if inside else ""
            text.append(f"{part} {ms:.3f}{detail}")
        lines.append(f"{row['engine']} batch {row['batch']}: " + "; ".join(text))
    return lines


def busiest_threads(rows, most: int = 3) -> list:
    """One line per row that recorded its threads: the ``most`` busiest and their CPU seconds, beside the row's wall
    seconds (a second thread near the main one's seconds is one busy beside it)."""
    lines = []
    for row in rows:
        threads = row.get("thread_cpu_s")
        if threads:
            wall = sum(row.get("seconds_by_repeat") or [row.get("seconds", 0.0)])
            top = ", ".join(f"{name} {seconds:.2f}" for name, seconds in list(threads.items())[:most])
            lines.append(f"{row['engine']} batch {row['batch']} ({wall:.2f}): {top}")
    return lines


def timed_params(args):
    """The timed runs' sampling: greedy by default; ``--temperature`` samples, with one seed per request under
    ``--seeded`` (a list, one ``SamplingParams`` per request); under ``--regex`` every request follows it."""
    from vllm import SamplingParams

    structured = None
    if getattr(args, "regex", None):
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(regex=args.regex)

    def params(seed=None, max_tokens=args.max_tokens):
        return SamplingParams(
            temperature=args.temperature,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            structured_outputs=structured,
        )

    if args.seeded and args.temperature <= 0:
        raise SystemExit("--seeded needs --temperature > 0 (greedy decoding draws no noise)")
    if getattr(args, "churn", False):
        lengths = churn_lengths(args.requests, args.max_tokens)
        return [params(i if args.seeded else None, int(n)) for i, n in enumerate(lengths)]
    if args.seeded:
        return [params(i) for i in range(args.requests)]
    return params()


def churn_lengths(requests: int, max_tokens: int) -> list:
    """``--churn``: request ``i``'s max_tokens, uniform in ``[max_tokens / 4, 7 max_tokens / 4]`` (mean
    ``max_tokens``), the same for every engine and run."""
    rnd = random.Random(1)
    low, high = max(1, max_tokens // 4), max(1, 7 * max_tokens // 4)
    return [rnd.randint(low, high) for _ in range(requests)]


def limit_running_requests(llm, limit: int) -> None:
    """``--churn``: at most ``limit`` requests run at once in the in-process engine (vLLM's scheduler admits a
    waiting request as a running one ends); the engine's ``max_num_seqs`` sized its buffers for the largest."""
    scheduler = inprocess_scheduler(llm)
    if scheduler is None:
        raise RuntimeError("--churn needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    scheduler.max_num_running_reqs = limit


def child_command(args, name: str, spec, gate: str) -> list:
    """The command line of one engine's subprocess."""
    memory = memory_share(args.gpu_memory_utilization, args.concurrent_starts)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--target",
        args.target,
        "--drafter",
        str(args.drafter),
    ]
    cmd += ["--batches", args.batches, "--max-tokens", str(args.max_tokens), "--requests", str(args.requests)]
    cmd += ["--temperature", str(args.temperature)] + (["--seeded"] if args.seeded else [])
    cmd += ["--regex", args.regex] if args.regex else []
    cmd += ["--prefix-caching"] if args.prefix_caching else []
    cmd += ["--prompt-len", str(args.prompt_len), "--max-model-len", str(args.max_model_len)]
    cmd += ["--gpu-memory-utilization", str(memory), "--repeats", str(args.repeats), "--draft-len", str(args.draft_len)]
    cmd += ["--profile-batches", args.profile_batches, "--profile-tokens", str(args.profile_tokens)]
    cmd += ["--name", name, "--out", args.out] + (["--profile-no-stacks"] if args.profile_no_stacks else [])
    cmd += ["--host-profile"] if args.host_profile else []
    cmd += ["--host-pieces"] if args.host_pieces else []
    cmd += ["--churn"] if args.churn else []
    cmd += engine_arguments(gate) + (["--interleave"] if args.interleave else [])
    if args.prompts:
        cmd += ["--prompts", args.prompts]
    if spec:
        cmd += ["--spec", json.dumps(spec)]
    if args.eager:
        cmd.append("--eager")
    return cmd


def run_engines(args, engines: list, env: dict) -> list:
    """Every engine's rows, in order (``engine_turns``: up to ``--concurrent-starts`` engines start at once, each
    engine's timed runs have the GPU alone). Rows are written as each engine ends."""
    gate = new_gate(args.out, args.concurrent_starts)
    jobs = [
        (name, child_command(args, name, spec, gate), os.path.join(args.out, f"bench_{name}.log"))
        for name, spec in engines
    ]
    rounds = timed_rounds(args) if args.interleave else 1
    table = []
    for turn in run_in_turns(jobs, gate, args.concurrent_starts, args.timeout, env, rounds=rounds):
        line = next((x for x in turn.stdout.splitlines() if x.startswith("RESULT-JSON ")), None)
        if line is not None:
            rows = json.loads(line[len("RESULT-JSON ") :])
            print(f"{turn.name}: done", flush=True)
        else:
            rows = kept_rows(args.out, turn.name)  # the batch sizes it finished before it died
            why = f"TIMEOUT after {args.timeout}s" if turn.outcome == "timeout" else f"FAILED rc={turn.returncode}"
            print(f"{turn.name}: {why}, see {args.out}/bench_{turn.name}.log; {len(rows)} rows kept", flush=True)
            if not rows:
                continue
            rows = [dict(row, partial=True) for row in rows]
        table += [dict(row, engine=turn.name) for row in rows]
        with open(os.path.join(args.out, "bench_vllm_ddtree.json"), "w") as f:  # kept if a later engine dies
            json.dump(table, f, indent=1)
    return table


def timed_rounds(args) -> int:
    """An interleaved engine's turns: one per timed run (every batch size, every repeat), and one for its profiles
    when it takes any (they run after its timed runs)."""
    return len(args.batches.split(",")) * args.repeats + (1 if profiled_batches(args) else 0)


def profiled_batches(args) -> list:
    """The batch sizes an engine profiles, in its batch order: those of ``--profile-batches`` it runs."""
    profiled = {int(x) for x in args.profile_batches.split(",") if x}
    return [b for b in (int(x) for x in args.batches.split(",")) if b in profiled]


def kept_rows(out: str, name: str) -> list:
    """The rows an engine wrote before it died (none when it finished no batch size)."""
    try:
        with open(partial_rows_path(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def add_round_ratios(table: list) -> None:
    """Each engine's tokens/s over vLLM's dflash's, run by run, as the median over the rounds (``--interleave``: run
        ``r`` of every engine sat in round ``r``, minutes apart at most): ``ratio_to_dflash_by_round``. Best against best
        compares two engines' luckiest runs, which at batch 1 may come from different rounds of a host whose speed moves
        by tens of percent between turns. Every engine served the same requests, so a run's ratio is the chain's seconds
        over the engine's. Rows without both sides' runs, run for run, get none (a partial row). Engine after engine
    (no ``--interleave``) the runs of a pair are minutes apart: the bench adds these ratios only when interleaved."""
    chain = {row["batch"]: row.get("seconds_by_repeat") for row in table if row["engine"] == "dflash"}
    for row in table:
        runs, chain_runs = row.get("seconds_by_repeat"), chain.get(row["batch"])
        if row["engine"] == "dflash" or not runs or not chain_runs or len(runs) != len(chain_runs):
            continue
        row["ratio_to_dflash_by_round"] = statistics.median(c / e for c, e in zip(chain_runs, runs) if e > 0)


def what_if_chain_checks(table: list) -> list:
    """``(engine, batch, estimated, measured)``: each ddtree row's estimate of the chain's acceptance length from its
    own trees (``acceptance_length_if_chain``, engine life) beside the dflash engine's measured one at that batch
    size (a check of the estimate; the two engines' states diverge, so close rather than equal)."""
    measured = {row["batch"]: row["mean_acceptance_length"] for row in table if row["engine"] == "dflash"}
    out = []
    for row in table:
        estimate = (row.get("acceptance_length_if_chain") or {}).get("acceptance_length")
        if estimate is not None and measured.get(row["batch"]) is not None:
            out.append((row["engine"], row["batch"], estimate, measured[row["batch"]]))
    return out


if __name__ == "__main__":
    main()
