"""Engines of a GPU bench, each in its own subprocess, started side by side and timed one at a time.

An engine's start (torch.compile, vLLM's profiling run, CUDA-graph capture) takes 2-4 minutes on an H200, and a
device call lasts at most 10: one after the other, three pair engines or two Qwen3.6-27B-shape engines fit. Started
side by side, the starts overlap; the timed runs must not share the GPU with anything, so each engine, once
started, says so (``wait_for_turn``: a ``<name>.ready`` file in the gate folder) and waits for its turn (a
``<name>.go`` file). :func:`run_in_turns` gives the turns in the engines' order, and only when no engine is still
starting: no start overlaps a timed run.

With ``rounds`` above 1 every engine is started at once and takes one turn per round, round by round in the engines'
order (``a b c a b c ...``): each engine's part of round ``r`` (one timed run of one batch size) sits beside the
other engines' part of the same round. The GPU host's speed drifts by tens of percent within minutes (the test
pair's chain ran 26.4 ms per step at batch 32 in one run and 18.6 in the session before,
``gpu-h200-pair-auto-2b70899``); engine after engine, a ratio compared two time windows minutes apart.
An engine waits for round ``r`` under :func:`round_name` ``(name, r)``.
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


def round_name(name: str, round_: int) -> str:
    """The gate's name for an engine's turn in ``round_`` (round 0, its first turn after the start: its own name)."""
    return name if round_ == 0 else f"{name}@{round_}"


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
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every engine resident at once (--concurrent-starts at least the number of engines), their timed runs "
        "taken in rounds, engine by engine within each round: every ratio then compares runs minutes apart at most",
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
    rounds: int = 1,
) -> Iterator[Turn]:
    """Runs every job, up to ``concurrent`` started at once, and yields a :class:`Turn` per job in the jobs' order
    as each ends. ``timeout`` bounds an engine's start and, again, its runs; with a ``deadline`` (``time.time()``
    seconds) a job is not started with less than ``min_left`` seconds to go, and no wait runs past it. With a gate
    an engine's turn comes once it and every other engine still starting are ready (or gone). With ``rounds`` above
    1, see :func:`_run_in_rounds` (``timeout`` then bounds the start and each round's turn)."""
    if rounds > 1:
        if not gate or concurrent < len(jobs):
            raise ValueError(
                f"{rounds} rounds need every engine started at once behind a gate: {len(jobs)} engines, "
                f"{concurrent} concurrent starts{'' if gate else ', no gate'}"
            )
        yield from _run_in_rounds(jobs, gate, timeout, env, deadline, min_left, rounds)
        return
    waiting: List[Job] = list(jobs)
    started: list = []  # (name, process or None when skipped, log, launched)
    while waiting or started:
        while waiting and len(started) < max(1, concurrent):
            name, command, log_path, *job_env = waiting.pop(0)
            if deadline is not None and deadline - time.time() < min_left:
                started.append((name, None, None, time.time()))
                continue
            log = open(log_path, "w")
            process = subprocess.Popen(
                command, env=_child_env(job_env, env), stdout=subprocess.PIPE, stderr=log, text=True
            )
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


def _run_in_rounds(
    jobs: Sequence[Job],
    gate: str,
    timeout: float,
    env: Optional[dict],
    deadline: Optional[float],
    min_left: float,
    rounds: int,
) -> Iterator[Turn]:
    """Every job started at once; round by round, each engine still running gets its turn (``round_name``), and
    the next engine's turn comes once it is ready for its next round or has exited. An engine that times out in a
    round is killed, and the others go on. Turns are yielded at the end, in the jobs' order. An engine's stdout
    goes to a file beside its log: nobody reads a pipe while the others take their turns."""
    end = float("inf") if deadline is None else deadline
    engines = []  # (name, process or None when skipped, log, stdout file, launched)
    for name, command, log_path, *job_env in jobs:
        if deadline is not None and deadline - time.time() < min_left:
            engines.append((name, None, None, None, time.time()))
            continue
        log, stdout = open(log_path, "w"), open(f"{log_path}.stdout", "w+")
        process = subprocess.Popen(command, env=_child_env(job_env, env), stdout=stdout, stderr=log, text=True)
        engines.append((name, process, log, stdout, time.time()))
    ended: dict = {}  # name -> Turn of an engine killed before its last round
    for name, process, _, _, launched in engines:  # no turn while any engine is still starting
        if process is not None:
            try:
                _wait_ready(gate, name, process, min(launched + timeout, end))
            except subprocess.TimeoutExpired:
                ended[name] = _killed(name, process)
    for round_ in range(rounds):
        for name, process, _, _, _ in engines:
            if process is None or name in ended or process.poll() is not None:
                continue
            open(os.path.join(gate, f"{round_name(name, round_)}.go"), "w").close()
            try:  # its turn ends when it is ready for its next round, or (the last) when it exits
                if round_ + 1 < rounds:
                    _wait_ready(gate, round_name(name, round_ + 1), process, min(time.time() + timeout, end))
                else:
                    process.wait(timeout=max(1.0, min(timeout, end - time.time())))
            except subprocess.TimeoutExpired:
                ended[name] = _killed(name, process)
    for name, process, log, stdout, _ in engines:
        if process is None:
            yield Turn(name, "skipped")
            continue
        turn = ended.get(name)
        if turn is None:
            try:
                process.wait(timeout=max(1.0, min(timeout, end - time.time())))
                stdout.seek(0)
                turn = Turn(name, "done" if process.returncode == 0 else "failed", stdout.read(), process.returncode)
            except subprocess.TimeoutExpired:
                turn = _killed(name, process)
        log.close()
        stdout.close()
        yield turn


def _child_env(job_env: list, env: Optional[dict]) -> dict:
    """An engine's environment: its job's own, else ``env``, else this process's; with this process as its parent."""
    return dict(job_env[0] if job_env else env or os.environ, **{PARENT_ENV: str(os.getpid())})


def _killed(name: str, process) -> Turn:
    process.kill()
    process.wait()
    return Turn(name, "timeout")


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
