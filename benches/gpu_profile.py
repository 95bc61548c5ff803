"""torch.profiler tables and a timeline of one vLLM ``generate``, for the GPU benchmark scripts beside this file."""

from __future__ import annotations

import gzip
import os
import shutil


def profile_generate(llm, prompts, params, path: str, row_limit: int = 40) -> None:
    """One more ``generate`` under torch.profiler. The top ops by GPU and by CPU time go to ``path``; the
    timeline (Chrome trace format, gzip) to ``path`` with ``.trace.json.gz`` in place of its extension: where
    the GPU waits for the host between kernels shows there, not in the tables.

    Works with vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the benches set) and one
    GPU: a tensor-parallel engine's other ranks run in processes the profiler does not see.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path, "w") as handle:
        handle.write(averages.table(sort_by="cuda_time_total", row_limit=row_limit) + "\n")
        handle.write(averages.table(sort_by="cpu_time_total", row_limit=row_limit) + "\n")
    raw = os.path.splitext(path)[0] + ".trace.json"
    prof.export_chrome_trace(raw)
    compress(raw)


def compress(path: str) -> str:
    """``path`` gzipped to ``path + '.gz'`` (the original removed); returns the new path."""
    with open(path, "rb") as source, gzip.open(path + ".gz", "wb") as target:
        shutil.copyfileobj(source, target)
    os.remove(path)
    return path + ".gz"
