"""The accepted paths of device-walked steps, on their way to the host for the statistics.

With the tree walk on the device (``device_accept``) the host learns what each tree accepted only from a copy of
the walk's ``path_lengths`` and ``paths`` (one ``[R, 1 + P]`` row per tree: the length, then the path). A
synchronous engine reads it at the end of the step (it landed with the chain rows vLLM's bookkeeping waited for). Under asynchronous scheduling the host runs a step ahead of the GPU, and a
wait there would stall it; so each step's copy goes into its own pinned slot, and a step is counted once its copy
has landed (``Event.query``), at the latest when every slot is in flight. The host looks only once ``read_every``
steps are in flight (an event query and a read each, then counted together): the statistics' host path took
0.62-0.65x its time read every step on CPU, cold (``cpu-stats-ring-4742664``; 0.054 ms a batch-1 step on the H200
host before, ``gpu-h200-pair-2b9ceeb``).

Torch only (no vLLM import): CI tests it on CPU, where copies land at once.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch


class LandingCounts:
    """``slots`` pinned buffers of ``max_reqs`` int32 counts (or rows of ``width`` counts), used in turn; the host
    reads landed ones once ``read_every`` steps are in flight (fewer than ``slots``: a full ring waits)."""

    def __init__(
        self, device: torch.device, max_reqs: int, slots: int = 4, width: Optional[int] = None, read_every: int = 1
    ):
        if not 1 <= read_every < slots:
            raise ValueError(f"LandingCounts: read_every must be 1 .. slots - 1 = {slots - 1}, got {read_every}")
        self.read_every = read_every
        on_gpu = torch.device(device).type == "cuda"
        shape = (max_reqs,) if width is None else (max_reqs, width)
        self._buffers = [torch.empty(shape, dtype=torch.int32, pin_memory=on_gpu) for _ in range(slots)]
        self._views: Dict[Tuple[int, int], torch.Tensor] = {}
        self._host = [buffer.numpy() for buffer in self._buffers]  # the same memory, read without torch's slicing
        self._events = [torch.cuda.Event() if on_gpu else None for _ in range(slots)]
        self._next = 0
        # (slot, number of counts, what the caller attached), oldest first
        self._in_flight: Deque[Tuple[int, int, Any]] = deque()

    def send(self, counts: torch.Tensor, tag: Any) -> Optional[Tuple[Any, np.ndarray]]:
        """Starts the copy of ``counts`` ``[R]`` (or ``[R, width]``); returns the oldest step's ``(tag, counts)`` when
        its slot had to be read first to make room (None otherwise)."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        evicted = None
        if self._in_flight and self._in_flight[0][0] == slot:
            evicted = self._read(wait=True)
        n = counts.shape[0]
        host = self._views.get((slot, n))
        if host is None:  # a slot's rows for n trees: one view per slot and batch size, made once
            host = self._views[(slot, n)] = self._buffers[slot][:n]
        host.copy_(counts, non_blocking=True)
        if self._events[slot] is not None:
            self._events[slot].record()
        self._in_flight.append((slot, counts.shape[0], tag))
        return evicted

    def landed(self, wait: bool) -> List[Tuple[Any, np.ndarray]]:
        """``(tag, counts)`` of every step whose copy has landed, oldest first (with ``wait``: of every step); without
        ``wait``, nothing until ``read_every`` steps are in flight."""
        if not wait and len(self._in_flight) < self.read_every:
            return []
        out = []
        while self._in_flight:
            step = self._read(wait)
            if step is None:
                break
            out.append(step)
        return out

    def _read(self, wait: bool) -> Optional[Tuple[Any, np.ndarray]]:
        slot, n, tag = self._in_flight[0]
        event = self._events[slot]
        if event is not None:
            if wait:
                event.synchronize()
            elif not event.query():
                return None
        self._in_flight.popleft()
        return tag, self._host[slot][:n].copy()

    def __len__(self) -> int:
        return len(self._in_flight)
