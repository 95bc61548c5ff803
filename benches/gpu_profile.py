"""torch.profiler tables and a timeline of one vLLM ``generate``, and the host time of a timed window, for the GPU
benchmark scripts beside this file."""

from __future__ import annotations

import bisect
import gzip
import json
import os
import shutil
from typing import Any, Dict


def scopes_on() -> bool:
    """Whether vLLM's named ranges are real ``record_function`` calls in this process (:func:`enable_scopes`): each
    costs microseconds to enter and leave, so timed rows taken with them on say so (``profiling_scopes``)."""
    return os.environ.get("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "0") == "1"


def enable_scopes() -> None:
    """vLLM's named ranges ("gpu_model_runner: preprocess", ... and ddtree's "ddtree: plan", ...) in profiles.

    vLLM reads the variable once, at its first range: call before the engine is built."""
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"


def profile_generate(llm, prompts, params, path: str, row_limit: int = 40, stacks: bool = True) -> dict:
    """One more ``generate`` under torch.profiler. The top ops by GPU and by CPU time go to ``path``; the
    timeline (Chrome trace format, gzip) to ``path`` with ``.trace.json.gz`` in place of its extension: where
    the GPU waits for the host between kernels shows there, not in the tables. Returns :func:`idle_summary` of
    the timeline, for the bench's JSON.

    Works with vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the benches set) and one
    GPU: a tensor-parallel engine's other ranks run in processes the profiler does not see.

    ``stacks=False`` leaves out the Python stacks (and so the table of syncs by call site): every host op then no
    longer carries its stack in the timeline, which for ~30 steps of the pair at batch 8 ran past 80 MB and took
    minutes to write on an H200 host.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    # with_stack: the host syncs (nonzero, item, blocking copies) are attributed to the Python lines that make
    # them (verbose: without it torch 2.11 records empty stacks).
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True) if stacks else None
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks, experimental_config=verbose
    ) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path, "w") as handle:
        handle.write(averages.table(sort_by="cuda_time_total", row_limit=row_limit) + "\n")
        handle.write(averages.table(sort_by="cpu_time_total", row_limit=row_limit) + "\n")
        if stacks:
            handle.write("Operations that can wait for the GPU, by the Python lines that made them:\n")
            handle.write(syncs_by_stack(prof, row_limit))
        handle.write("\nNamed ranges (vLLM's runner phases, ddtree's parts; needs enable_scopes()):\n")
        handle.write(scopes_table(averages))
    raw = os.path.splitext(path)[0] + ".trace.json"
    prof.export_chrome_trace(raw)
    with open(raw) as trace:
        events = json.load(trace)["traceEvents"]
    measured = idle_by_range(events)  # one pass over the timeline for both
    with open(path, "a") as handle:
        # Host times here are inflated by the profiler's Python tracing; the shares of idle time are the point.
        handle.write("\n" + idle_table(events, params.max_tokens, measured))
        by_range = calls_by_range(events)
        handle.write("\n" + calls_table(by_range))
    compress(raw)
    return dict(idle_summary(events, params.max_tokens, measured=measured), host_calls_by_ddtree_range=by_range)


#: Operations whose host side can block until the GPU catches up (a data-dependent size, a scalar, a copy).
SYNCING_OPS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaStreamSynchronize")


def syncs_by_stack(prof, row_limit: int = 40) -> str:
    """One line per (syncing op, Python call site), most CPU time first: where a step waits for the GPU."""
    events = [e for e in prof.key_averages(group_by_stack_n=8) if e.key in SYNCING_OPS]
    events.sort(key=lambda e: e.cpu_time_total, reverse=True)
    lines = []
    for event in events[:row_limit]:
        frames = [frame for frame in event.stack if ".py(" in frame][:4]
        where = " <- ".join(frames) or "(no Python frame)"
        lines.append(f"{event.key:<26} calls {event.count:>6}  CPU ms {event.cpu_time_total / 1e3:>9.2f}  {where}\n")
    return "".join(lines)


#: Prefixes of the named ranges: vLLM's runner phases and ddtree's own parts.
SCOPE_PREFIXES = ("gpu_model_runner:", "ddtree:")


def scopes_table(averages) -> str:
    """One line per named range: calls, host ms in total and per call (a wait range's time is GPU time the host
    spent waiting)."""
    lines = []
    for event in sorted(averages, key=lambda e: e.cpu_time_total, reverse=True):
        if event.key.startswith(SCOPE_PREFIXES):
            lines.append(
                f"{event.key:<48} calls {event.count:>5}  CPU ms {event.cpu_time_total / 1e3:>9.2f}"
                f"  per call {event.cpu_time_total / 1e3 / max(event.count, 1):>7.3f}\n"
            )
    return "".join(lines) or "(none: scopes were off)\n"


def merged(intervals):
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


#: Chrome-trace categories of work on the GPU (kernels and copies; not the GPU side of named ranges).
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_by_range(trace_events, min_gap_us: float = 5.0):
    """Where the GPU waited for the host: ``(busy us, span us, {range name: idle us})`` from a Chrome trace's
    events. Each stretch with no kernel or copy running is charged to the innermost named range (vLLM's phases,
    ddtree's parts, the engine's own) the host was in at the time, ``(no range)`` outside all of them."""
    events = [e for e in trace_events if e.get("ph") == "X"]
    gpu = merged((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_WORK)
    if not gpu:
        return 0.0, 0.0, {}
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation")
    idle = {}
    for (_, gap_start), (gap_end, _) in zip(gpu, gpu[1:]):
        if gap_end - gap_start < min_gap_us:
            continue
        around = [r for r in ranges if r[0] < gap_end and r[1] > gap_start]
        cuts = sorted({gap_start, gap_end, *(t for r in around for t in r[:2] if gap_start < t < gap_end)})
        for lo, hi in zip(cuts, cuts[1:]):
            covering = [r for r in around if r[0] <= lo and r[1] >= hi]
            name = min(covering, key=lambda r: r[1] - r[0])[2] if covering else "(no range)"
            idle[name] = idle.get(name, 0.0) + hi - lo
    busy = sum(end - start for start, end in gpu)
    return busy, gpu[-1][1] - gpu[0][0], idle


#: Kernel families, first match wins: where a tree step's GPU time goes next to the chain's (ddtree's kernels, vLLM's
#: own GDN and attention kernels, the GEMMs, torch.compile's fused Triton kernels).
KERNEL_FAMILIES = (
    ("ddtree tree GDN", r"_tree_gdn_fwd_kernel"),
    ("ddtree GDN/conv commit", r"_tree_gdn_commit_kernel|_tree_conv_commit_kernel"),
    ("ddtree tree conv", r"_tree_conv_qkv_kernel"),
    ("ddtree tree attention", r"_paged_tree_attention|_merge_splits"),
    ("vLLM GDN", r"delta_rule|gated_delta|fused_recurrent|chunk_|causal_conv1d|fused_gdn|solve_tril|recompute_w_u"),
    ("vLLM attention", r"flash|unified_attention|fmha|attn"),
    ("GEMM", r"nvjet|gemm|cutlass|xmma|splitKreduce|cublas"),
    ("torch.compile fused", r"^triton_"),
    ("sampling / top-K", r"topk|sort|sampl|argmax|softmax|gumbel|rejection"),
)


def kernel_family(name: str) -> str:
    """The :data:`KERNEL_FAMILIES` entry a kernel name belongs to ("other" when none)."""
    import re

    return next((family for family, pattern in KERNEL_FAMILIES if re.search(pattern, name)), "other")


def gpu_ms_by_family(trace_events, tokens: int) -> dict:
    """GPU milliseconds per output token (``tokens``: the generate's max_tokens) by kernel family, copies and
    memsets as "copies", from a Chrome trace's events; largest first."""
    totals = {}
    for event in trace_events:
        if event.get("ph") != "X" or event.get("cat") not in GPU_WORK:
            continue
        family = kernel_family(event.get("name", "")) if event["cat"] == "kernel" else "copies"
        totals[family] = totals.get(family, 0.0) + event.get("dur", 0.0)
    per_token = 1e3 * max(tokens, 1)
    return {family: round(us / per_token, 4) for family, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def family_comparison(mine: dict, chain: dict) -> str:
    """Two :func:`gpu_ms_by_family` results side by side (ms per output token), with the difference; the families
    that differ most first."""
    families = sorted(set(mine) | set(chain), key=lambda f: -abs(mine.get(f, 0.0) - chain.get(f, 0.0)))
    lines = [f"{'kernel family':<26}{'ddtree':>10}{'chain':>10}{'difference':>12}\n"]
    for family in families:
        a, b = mine.get(family, 0.0), chain.get(family, 0.0)
        lines.append(f"{family:<26}{a:>10.3f}{b:>10.3f}{a - b:>+12.3f}\n")
    total_a, total_b = sum(mine.values()), sum(chain.values())
    lines.append(f"{'all GPU work':<26}{total_a:>10.3f}{total_b:>10.3f}{total_a - total_b:>+12.3f}\n")
    return "".join(lines)


#: Trace categories of the host calls counted inside ddtree's ranges: CUDA API calls and torch ops.
HOST_CALL_CATEGORIES = ("cuda_runtime", "cuda_driver", "cpu_op")


def calls_by_range(trace_events, prefix: str = "ddtree: ") -> dict:
    """For each host range named ``prefix...`` (ddtree's timed parts): how many there were, their mean host us, and
    the CUDA API calls and torch ops inside them on the same thread, ``{name: [calls per range, us per range]}``
    (nested ops counted at each level: ``aten::copy_`` and the ``cudaMemcpyAsync`` inside it both). What is left of
    a range's time beyond its calls is Python (and Rust) between them."""
    ranges = [e for e in trace_events if e.get("cat") == "user_annotation" and "dur" in e]
    ranges = [e for e in ranges if e.get("name", "").startswith(prefix)]
    calls: Dict[Any, list] = {}
    for e in trace_events:
        if e.get("cat") in HOST_CALL_CATEGORIES and "dur" in e:
            calls.setdefault(e.get("tid"), []).append(e)
    for events in calls.values():
        events.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in events] for tid, events in calls.items()}
    out: Dict[str, dict] = {}
    for r in ranges:
        entry = out.setdefault(r["name"], {"ranges": 0, "us": 0.0, "calls": {}})
        entry["ranges"] += 1
        entry["us"] += r["dur"]
        events, first = calls.get(r.get("tid"), []), starts.get(r.get("tid"), [])
        i = bisect.bisect_left(first, r["ts"])
        while i < len(events) and events[i]["ts"] < r["ts"] + r["dur"]:
            name = events[i]["name"]
            count = entry["calls"].setdefault(name, [0, 0.0])
            count[0] += 1
            count[1] += events[i]["dur"]
            i += 1
    for entry in out.values():
        n = entry["ranges"]
        entry["us"] = round(entry["us"] / n, 1)
        entry["calls"] = {
            name: [round(c / n, 2), round(us / n, 1)]
            for name, (c, us) in sorted(entry["calls"].items(), key=lambda kv: -kv[1][1])
        }
    return out


def calls_table(by_range: dict, most: int = 8) -> str:
    """:func:`calls_by_range` as text: each range's mean host us, then its ``most`` costliest calls."""
    lines = ["Host calls inside ddtree's ranges (per range; the rest of a range is Python and Rust):\n"]
    for name, entry in sorted(by_range.items(), key=lambda kv: -kv[1]["us"] * kv[1]["ranges"]):
        lines.append(f"  {name} ({entry['ranges']} ranges): {entry['us']:.1f} us each\n")
        for call, (count, us) in list(entry["calls"].items())[:most]:
            lines.append(f"      {call[:60]:<60} {count:>6.2f} x {us:>9.1f} us\n")
    return "".join(lines)


def idle_summary(trace_events, tokens: int, most: int = 8, measured=None) -> dict:
    """:func:`idle_by_range` in ms per output token (``tokens``: the generate's max_tokens): GPU busy, the span, and
    the ``most`` host ranges the GPU waited in longest (``measured``: its result when the caller has it)."""
    busy, span, idle = measured or idle_by_range(trace_events)
    per_token = 1e3 * max(tokens, 1)
    waited = sorted(idle.items(), key=lambda kv: -kv[1])[:most]
    return {
        "gpu_busy_ms_per_token": round(busy / per_token, 3),
        "span_ms_per_token": round(span / per_token, 3),
        "idle_ms_per_token_by_host_range": {name: round(us / per_token, 3) for name, us in waited},
        "gpu_ms_per_token_by_kernel_family": gpu_ms_by_family(trace_events, tokens),
        "note": "profiled: Python tracing inflates host time (about 3x at the 27B shape)",
    }


def idle_table(trace_events, tokens: int, measured=None) -> str:
    """:func:`idle_by_range` as text, in total and per output token of a request (``tokens``: the generate's
    max_tokens; with a drafter that is never accepted, as the 27B bench's dummy one, one token is one step;
    ``measured``: its result when the caller has it)."""
    busy, span, idle = measured or idle_by_range(trace_events)
    if not span:
        return "GPU busy: no GPU work in the trace\n"
    lines = [
        f"GPU busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.1f}%); "
        f"the GPU waited for the host in (ms in total, per output token of {tokens}):\n"
    ]
    for name, waited in sorted(idle.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<48} {waited / 1e3:>9.2f} {waited / 1e3 / tokens:>8.2f}\n")
    return "".join(lines)


def compress(path: str) -> str:
    """``path`` gzipped to ``path + '.gz'`` (the original removed); returns the new path."""
    with open(path, "rb") as source, gzip.open(path + ".gz", "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(path)
    return path + ".gz"


#: The summary's host ms inside ddtree's own graph replays, by graph (a part of ``host_ms_per_verify_step``).
GRAPH_LAUNCH_MS = "graph_launch_ms_per_verify_step"
#: ... and of named pieces of the parts (``DDTreeStats.detail``), also a part of them, over the same steady steps.
HOST_DETAIL_MS = "host_detail_ms_per_verify_step"


def inprocess_scheduler(llm):
    """vLLM's scheduler of an engine whose core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the
    benches start them); None for a client of a core in another process."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def counter_deltas(before: dict, after: dict, names) -> dict:
    """``{name: after - before}`` of the ``ddtree_summary`` counters ``names`` between two snapshots (absent: 0)."""
    return {name: after.get(name, 0) - before.get(name, 0) for name in names}


def timed_host_ms(before: dict, after: dict, key: str = "host_ms_per_verify_step") -> dict:
    """Host ms per verify step, by part, over the steps between two ``ddtree_summary`` snapshots.

    The summary's own figures average over the engine's life, so one-time costs (a size's first commit with its
    graph capture, Triton compiles) would weigh in: up to 17 ms of "commit" per step in the records before
    gpu-h200-gdn-metadata-ffa8839, where the steady state is 0.3 ms. ``key``: ``vllm_host_ms_per_verify_step`` for
    the parts of vLLM's step the runner times (the forward's launch)."""
    # ddtree's own parts average over the steady steps (``steady_verify_steps``: no first run of a step graph's
    # shape), vLLM's over all; summaries from before that split have verify steps only.
    count = "verify_steps" if key == "vllm_host_ms_per_verify_step" else "steady_verify_steps"
    if count not in after:
        count = "verify_steps"
    steps_then = before.get(count, before["verify_steps"])
    steps = after[count] - steps_then
    if steps <= 0:
        return {}
    now, then = after.get(key, {}), before.get(key, {})
    return {part: (ms * after[count] - then.get(part, 0.0) * steps_then) / steps for part, ms in now.items()}


def host_ms_fields(before: dict, after: dict, vllm_parts: bool = True) -> dict:
    """A bench row's host figures between two ``ddtree_summary`` snapshots: ddtree's host ms per steady verify
    step by part, of them the ms inside its graph launches, vLLM's timed parts (``vllm_parts``), and the steps that
    ran a graph shape for the first time with their mean host ms (:func:`first_run_steps`)."""
    fields = {"host_ms_per_verify_step": timed_host_ms(before, after)}
    if vllm_parts:
        fields["vllm_host_ms_per_verify_step"] = timed_host_ms(before, after, "vllm_host_ms_per_verify_step")
    fields[GRAPH_LAUNCH_MS] = timed_host_ms(before, after, GRAPH_LAUNCH_MS)
    # What the parts are made of (``DDTreeStats.detail``: "plan: device upload", "defer: copy", ...).
    fields[HOST_DETAIL_MS] = timed_host_ms(before, after, HOST_DETAIL_MS)
    fields.update(first_run_steps(before, after))
    return fields


def first_run_steps(before: dict, after: dict) -> dict:
    """The steps between two ``ddtree_summary`` snapshots that ran a step graph's shape for the first time, and their
    mean host ms (``first_runs``, ``host_ms_per_first_run``): one-time costs, kept out of the host ms per step."""
    runs = after.get("first_run_steps", 0) - before.get("first_run_steps", 0)
    ms = sum(after.get("first_run_host_ms", {}).values()) - sum(before.get("first_run_host_ms", {}).values())
    return {"first_runs": runs, "host_ms_per_first_run": ms / runs if runs else None}
