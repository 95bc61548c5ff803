"""ddtree's timed host work under ``cProfile``, on demand (the benches' ``--host-profile``).

The runner's host timers say how long each part of a step takes; on a GPU host they read 2-4x what the same code
takes on a development CPU, and grow with the batch where the CPU's do not (``gpu-h100-pair-ffefa8b``). This says
where: one profile per timed part (plan, accept, commit, ...; a nested block counts in the outer one's), each
function by the time spent inside it with its callees (what a part's time is made of) and by its own time, and
the garbage collections that ran inside the blocks (a collection's cost grows with the objects the engine loop
allocates, and lands on whatever code allocated when it triggered). Outside the blocks nothing is profiled. No
vLLM import: CI tests it on CPU.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from typing import Dict, Optional


class HostProfile:
    """One profiling window: a ``cProfile`` profiler per timed part, on while a block of that part runs (nested
    blocks once, in the outer block's part), and the garbage collections that started inside one, by generation,
    with their seconds."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.profilers: Dict[str, cProfile.Profile] = {}
        self._running: Optional[cProfile.Profile] = None
        self.depth = 0
        self.collections = [0, 0, 0]
        self.gc_seconds = 0.0
        self._gc_started: Optional[float] = None
        gc.callbacks.append(self._on_collection)

    def enter(self, part: str) -> None:
        self.depth += 1
        if self.depth == 1:
            profiler = self.profilers.get(part)
            if profiler is None:
                profiler = self.profilers[part] = cProfile.Profile()
            self._running = profiler
            profiler.enable()

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self._running is not None:
            self._running.disable()
            self._running = None

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
        if self._running is not None:
            self._running.disable()
            self._running = None

    def report(self, steps: int, limit: int) -> str:
        """Ends the window; its text: the verify steps it covers, the collections inside the blocks, then for each
        part the ``limit`` functions with the most time including their callees (``pstats``' ``cumulative``) and
        the ``limit`` with the most of their own (``tottime``)."""
        self.close()
        out = io.StringIO()
        out.write(f"ddtree's timed host work, {steps - self.first_step} verify steps (totals, not per step)\n")
        gen0, gen1, gen2 = self.collections
        out.write(
            f"garbage collections inside the timed blocks: gen0 {gen0}, gen1 {gen1}, gen2 {gen2}; "
            f"{1e3 * self.gc_seconds:.3f} ms\n"
        )
        ran = False
        for part, profiler in sorted(self.profilers.items()):
            profiler.create_stats()
            if not profiler.stats:  # (pstats refuses an empty profile)
                continue
            ran = True
            for order in ("cumulative", "tottime"):
                out.write(f"\n=== {part}: by {order} time ===\n")
                pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(limit)
        if not ran:
            out.write("(no timed host work ran in the window)\n")
        return out.getvalue()
