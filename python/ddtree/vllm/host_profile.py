"""ddtree's timed host work under ``cProfile``, on demand (the benches' ``--host-profile``).

The runner's host timers say how long each part of a step takes; on a GPU host they read 2-4x what the same code
takes on a development CPU, and grow with the batch where the CPU's do not (``gpu-h100-pair-ffefa8b``). This says
where: every function called inside a timed block, by its own time, and the garbage collections that ran inside
the blocks (a collection's cost grows with the objects the engine loop allocates, and lands on whatever code
allocated when it triggered). Outside the blocks nothing is profiled. No vLLM import: CI tests it on CPU.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from typing import Optional


class HostProfile:
    """One profiling window: a ``cProfile`` profiler on while a timed block runs (nested blocks once), and the
    garbage collections that started inside one, by generation, with their seconds."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.profiler = cProfile.Profile()
        self.depth = 0
        self.collections = [0, 0, 0]
        self.gc_seconds = 0.0
        self._gc_started: Optional[float] = None
        gc.callbacks.append(self._on_collection)

    def enter(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.profiler.enable()

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.profiler.disable()

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter() if self.depth > 0 else None
        elif self._gc_started is not None:
            self.gc_seconds += time.perf_counter() - self._gc_started
            self.collections[min(int(info.get("generation", 0)), 2)] += 1
            self._gc_started = None

    def close(self) -> None:
        """Ends the window: profiling and collection counting stop."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        self.profiler.disable()

    def report(self, steps: int, limit: int) -> str:
        """Ends the window; its text: the verify steps it covers, the collections inside the blocks, then the
        ``limit`` functions with the most time of their own (``pstats``, by ``tottime``)."""
        self.close()
        out = io.StringIO()
        out.write(f"ddtree's timed host work, {steps - self.first_step} verify steps (totals, not per step)\n")
        gen0, gen1, gen2 = self.collections
        out.write(
            f"garbage collections inside the timed blocks: gen0 {gen0}, gen1 {gen1}, gen2 {gen2}; "
            f"{1e3 * self.gc_seconds:.3f} ms\n"
        )
        self.profiler.create_stats()
        if not self.profiler.stats:  # (pstats refuses an empty profile)
            out.write("(no timed host work ran in the window)\n")
            return out.getvalue()
        pstats.Stats(self.profiler, stream=out).sort_stats("tottime").print_stats(limit)
        return out.getvalue()
