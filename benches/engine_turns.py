"""Engines of a GPU bench, each in its own subprocess, started side by side and timed one at a time.

An engine's start (torch.compile, vLLM's profiling run, CUDA-graph capture) takes 2-4 minutes on an H200, and a
device call lasts at most 10: one after the other, three pair engines or two Qwen3.6-27B-shape engines fit. Started
side by side, the starts overlap; the timed runs must not share the GPU with anything, so each engine, once
started, says so (``wait_for_turn``: a ``<name>.ready`` file in the gate folder) and waits for its turn (a
``<name>.go`` file). :func:`run_in_turns` gives the turns in the engines' order, and only when no engine is still
starting: no start overlaps a timed run.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence


#: The environment variable that tells an engine which process started it.
PARENT_ENV = "ENGINE_TURNS_PARENT"


def wait_for_turn(gate: str, name: str) -> None:
    """In an engine's process, once it has started: say so, and wait until it may use the GPU alone. An engine
    whose parent is gone exits instead of holding its GPU memory forever."""
    # The parent that started this engine (``run_in_turns`` says which: by now it may be gone already).
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))
    open(os.path.join(gate, f"{name}.ready"), "w").close()
    while not os.path.exists(os.path.join(gate, f"{name}.go")):
        if os.getppid() != parent:
            raise SystemExit(f"{name}: the bench that started this engine is gone")
        time.sleep(0.05)


def add_arguments(parser) -> None:
    """``--concurrent-starts`` for a bench's parent, and the hidden ``--gate`` and ``--kv-cache-gib`` it passes to the
    engines it starts."""
    import argparse

    parser.add_argument(
        "--concurrent-starts",
        type=int,
        default=1,
        help="engines starting at once (default 1: one after the other). Their starts overlap (vLLM's profiling run, "
        "torch.compile, graph capture: 2-3 minutes per pair engine on an H200); each engine's timed runs or scenarios "
        "still have the GPU to themselves, in --engines order. Above 1 every engine gets a fixed KV cache instead of "
        "vLLM's memory profiling (which would count the other engines' allocations)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--gate", default="", help=argparse.SUPPRESS)


#: KV cache per engine when engines start side by side: the pair bench's and the e2e harness's largest batches (32
#: requests of up to 2048 tokens) need well under 1 GiB with the test pair; vLLM's profiling would give each tens.
CONCURRENT_KV_CACHE_GIB = 4.0


def engine_arguments(gate: str) -> list:
    """What a bench's parent adds to an engine's command line when engines start side by side (nothing otherwise)."""
    return ["--gate", gate, "--kv-cache-gib", str(CONCURRENT_KV_CACHE_GIB)] if gate else []


def kv_cache_kwargs(kv_cache_gib: float) -> dict:
    """The ``LLM`` keyword for an engine's fixed KV cache (none: vLLM's memory profiling sizes it). Engines starting
    side by side need it: the profiling would count the other engines' allocations as its own."""
    return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib else {}


def memory_share(utilization: float, concurrent: int) -> float:
    """The ``gpu_memory_utilization`` of one of ``concurrent`` engines sharing a GPU (at most 90% in all)."""
    return min(utilization, 0.9 / concurrent) if concurrent > 1 else utilization


def new_gate(out_dir: str, concurrent: int) -> str:
    """The gate folder for ``concurrent`` engines at once ("" for one at a time: no gate, no waiting)."""
    return tempfile.mkdtemp(prefix="gate_", dir=out_dir) if concurrent > 1 else ""


#: One engine: its name, its command line, the file its stderr goes to, and optionally its environment (a dict; the
#: ``env`` of :func:`run_in_turns` otherwise).
Job = tuple


@dataclass
class Turn:
    """How one engine ended: ``outcome`` "done" (exit status 0), "failed" (another status, or it could not be
    waited for), "timeout" (its start, or its runs, took longer than allowed; killed) or "skipped" (not started:
    too little time left before the deadline)."""

    name: str
    outcome: str
    stdout: str = ""
    returncode: Optional[int] = None


def run_in_turns(
    jobs: Sequence[Job],
    gate: str,
    concurrent: int,
    timeout: float,
    env: Optional[dict] = None,
    deadline: Optional[float] = None,
    min_left: float = 45.0,
) -> Iterator[Turn]:
    """Runs every job, up to ``concurrent`` started at once, and yields a :class:`Turn` per job in the jobs' order
    as each ends. ``timeout`` bounds an engine's start and, again, its runs; with a ``deadline`` (``time.time()``
    seconds) a job is not started with less than ``min_left`` seconds to go, and no wait runs past it. With a gate
    an engine's turn comes once it and every other engine still starting are ready (or gone)."""
    waiting: List[Job] = list(jobs)
    started: list = []  # (name, process or None when skipped, log, launched)
    while waiting or started:
        while waiting and len(started) < max(1, concurrent):
            name, command, log_path, *job_env = waiting.pop(0)
            if deadline is not None and deadline - time.time() < min_left:
                started.append((name, None, None, time.time()))
                continue
            log = open(log_path, "w")
            child_env = dict(job_env[0] if job_env else env or os.environ, **{PARENT_ENV: str(os.getpid())})
            process = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=log, text=True)
            started.append((name, process, log, time.time()))
        name, process, log, launched = started.pop(0)
        if process is None:
            yield Turn(name, "skipped")
            continue
        others = [(n, p, t) for n, p, _, t in started if p is not None]
        try:
            turn = _take_turn(gate, name, process, launched, timeout, others, deadline)
        finally:
            log.close()
        yield turn


def _take_turn(
    gate: str, name: str, process, launched: float, timeout: float, starting, deadline: Optional[float]
) -> Turn:
    end = float("inf") if deadline is None else deadline
    try:
        if gate:
            _wait_ready(gate, name, process, min(launched + timeout, end))
            for other, other_process, other_launched in starting:
                try:
                    _wait_ready(gate, other, other_process, min(other_launched + timeout, end))
                except subprocess.TimeoutExpired:
                    pass  # its own turn kills it and says so
            open(os.path.join(gate, f"{name}.go"), "w").close()
        stdout, _ = process.communicate(timeout=max(1.0, min(timeout, end - time.time())))
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return Turn(name, "timeout")
    except Exception:
        traceback.print_exc()
        process.kill()
        return Turn(name, "failed")
    return Turn(name, "done" if process.returncode == 0 else "failed", stdout, process.returncode)


def _wait_ready(gate: str, name: str, process, ready_by: float) -> None:
    """Returns once the engine is ready or has exited; raises ``TimeoutExpired`` past ``ready_by`` (``time.time()``)."""
    while not os.path.exists(os.path.join(gate, f"{name}.ready")) and process.poll() is None:
        if time.time() > ready_by:
            raise subprocess.TimeoutExpired(name, ready_by)
        time.sleep(0.2)
