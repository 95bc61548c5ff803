"""torch.profiler tables and a timeline of one vLLM ``generate``, for the GPU benchmark scripts beside this file."""

from __future__ import annotations

import gzip
import os
import shutil


def enable_scopes() -> None:
    """vLLM's named ranges ("gpu_model_runner: preprocess", ... and ddtree's "ddtree: plan", ...) in profiles.

    vLLM reads the variable once, at its first range: call before the engine is built."""
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"


def profile_generate(llm, prompts, params, path: str, row_limit: int = 40) -> None:
    """One more ``generate`` under torch.profiler. The top ops by GPU and by CPU time go to ``path``; the
    timeline (Chrome trace format, gzip) to ``path`` with ``.trace.json.gz`` in place of its extension: where
    the GPU waits for the host between kernels shows there, not in the tables.

    Works with vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the benches set) and one
    GPU: a tensor-parallel engine's other ranks run in processes the profiler does not see.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    # with_stack: the host syncs (nonzero, item, blocking copies) are attributed to the Python lines that make
    # them (verbose: without it torch 2.11 records empty stacks).
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, experimental_config=stacks
    ) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path, "w") as handle:
        handle.write(averages.table(sort_by="cuda_time_total", row_limit=row_limit) + "\n")
        handle.write(averages.table(sort_by="cpu_time_total", row_limit=row_limit) + "\n")
        handle.write("Operations that can wait for the GPU, by the Python lines that made them:\n")
        handle.write(syncs_by_stack(prof, row_limit))
        handle.write("\nNamed ranges (vLLM's runner phases, ddtree's parts; needs enable_scopes()):\n")
        handle.write(scopes_table(averages))
        handle.write("\n" + gpu_busy_line(prof.events()) + "\n")
    raw = os.path.splitext(path)[0] + ".trace.json"
    prof.export_chrome_trace(raw)
    compress(raw)


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


def busy_microseconds(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def gpu_busy_line(events) -> str:
    """How much of the profiled span the GPU ran kernels or copies: the rest it waited for the host."""
    from torch.autograd import DeviceType

    gpu, host = [], []
    for event in events:
        interval = (event.time_range.start, event.time_range.end)
        (gpu if event.device_type == DeviceType.CUDA else host).append(interval)
    if not gpu or not host:
        return "GPU busy: no GPU events"
    span = max(end for _, end in host + gpu) - min(start for start, _ in host + gpu)
    busy = busy_microseconds(gpu)
    return f"GPU busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.1f}%)"


def compress(path: str) -> str:
    """``path`` gzipped to ``path + '.gz'`` (the original removed); returns the new path."""
    with open(path, "rb") as source, gzip.open(path + ".gz", "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(path)
    return path + ".gz"
