"""The accepted paths of device-walked steps, on their way to the host for the statistics.

With the tree walk on the device (``device_accept``) the host learns what each tree accepted only from the walk's
``path_rows`` (one ``[R, 1 + P]`` row per tree: the length, then the path). The walk itself writes them into a
device ring, slot ``serial % slots``, with the step's serial beside them (:meth:`PathRing.write`: three small
kernels inside the walk's CUDA graph, no launch on the host's path); the serial comes from the host in the plan's
upload, so a step's slot and its check travel with the step's own data. Every ``slots`` noted steps the host copies
the whole ring to a pinned buffer in one copy and records one event; a copy is read once it has landed
(``Event.query``: never a wait on the engine loop, except for a copy still in flight when its pinned buffer is
needed again, or when the summary is read). A slot whose serial is not the step's (a step whose walk did not run,
or a serial skipped within one copy's window) is not counted, and is counted as lost.

Before, every step copied its own rows to the host and recorded an event (0.087 ms of host work per batch-1 step
on the pair's H200 host for the statistics, ``gpu-h200-pair-38e16ce``).

Torch only (no vLLM import): CI tests it on CPU, where copies land at once.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Tuple

import numpy as np
import torch

#: The serial column is int32: serials are compared modulo 2**31.
_SERIAL_MASK = 0x7FFFFFFF

#: ``(serial, number of trees, what the caller attached)`` of one noted step.
NotedStep = Tuple[int, int, Any]


class PathRing:
    """``slots`` device slots of ``max_reqs`` rows of ``width`` int32, each with the serial of the step that wrote
    it; the host copies all of them every ``slots`` noted steps into one of two pinned buffers."""

    def __init__(
        self,
        device: torch.device,
        max_reqs: int,
        width: int,
        slots: int = 4,
        current_stream: Callable[[], torch.cuda.Stream] = torch.cuda.current_stream,
    ):
        if slots < 1 or max_reqs < 1 or width < 1:
            raise ValueError(f"PathRing: slots, max_reqs and width must be positive, got {slots}, {max_reqs}, {width}")
        self.slots, self.max_reqs, self.width = slots, max_reqs, width
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        # Row ``max_reqs`` of each slot holds, in its first column, the serial of the step that wrote the slot.
        self.ring = torch.zeros((slots, max_reqs + 1, width), dtype=torch.int32, device=self.device)
        self.ring[:, max_reqs, 0] = -1
        self._host = [torch.empty(self.ring.shape, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._host_arrays = [buffer.numpy() for buffer in self._host]  # the same memory, read without torch
        self._events = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._current_stream = current_stream  # (the adapter passes vLLM's: see ``StepStaging``)
        self._next_buffer = 0
        self._noted: List[NotedStep] = []
        self._in_flight: Deque[Tuple[int, List[NotedStep]]] = deque()  # (pinned buffer, its steps), oldest first
        self.lost_steps = 0

    # ---- the device side (inside the walk; capturable: no host sync, fixed shapes) ----
    def write(self, rows: torch.Tensor, serial: torch.Tensor) -> None:
        """Writes a step's ``rows`` ``[R, width]`` int32 into slot ``serial % slots``, and ``serial`` (a ``[1]``
        int64 device tensor) beside them."""
        if rows.shape[0] > self.max_reqs or rows.shape[1] != self.width:
            raise ValueError(
                f"PathRing: rows of shape {tuple(rows.shape)} do not fit {self.max_reqs} rows of width {self.width}"
            )
        slot = serial.remainder(self.slots)
        self.ring[:, : rows.shape[0]].index_copy_(0, slot, rows.to(torch.int32).unsqueeze(0))
        stamp = (serial & _SERIAL_MASK).to(torch.int32)
        self.ring[:, self.max_reqs, 0].index_copy_(0, slot, stamp)

    # ---- the host side ----
    def note(self, serial: int, num_trees: int, tag: Any) -> List[Tuple[Any, np.ndarray]]:
        """After a step whose walk wrote ``num_trees`` rows under ``serial``: every ``slots``-th noted step starts
        the copy of the ring to the host. Returns the steps of an older copy that had to be read first to free its
        pinned buffer (empty otherwise): ``(tag, rows)`` each."""
        self._noted.append((serial, num_trees, tag))
        if len(self._noted) < self.slots:
            return []
        return self._send()

    def landed(self, wait: bool) -> List[Tuple[Any, np.ndarray]]:
        """``(tag, rows)`` of every step whose copy has landed, oldest first. With ``wait`` (the summary's read):
        the steps noted since the last copy are copied now, and every copy is waited for."""
        out = self._send() if wait and self._noted else []
        while self._in_flight:
            buffer, _ = self._in_flight[0]
            event = self._events[buffer]
            if event is not None:
                if wait:
                    event.synchronize()
                elif not event.query():
                    break
            out.extend(self._read_oldest())
        return out

    def _send(self) -> List[Tuple[Any, np.ndarray]]:
        buffer = self._next_buffer
        self._next_buffer = 1 - buffer
        freed: List[Tuple[Any, np.ndarray]] = []
        if any(held == buffer for held, _ in self._in_flight):  # both buffers in flight: read the older one
            event = self._events[buffer]
            if event is not None:
                event.synchronize()
            freed = self._read_oldest()
        self._host[buffer].copy_(self.ring, non_blocking=True)
        if self._events[buffer] is not None:
            self._events[buffer].record(self._current_stream())
        self._in_flight.append((buffer, self._noted))
        self._noted = []
        return freed

    def _read_oldest(self) -> List[Tuple[Any, np.ndarray]]:
        """The oldest copy's steps, ``(tag, rows)`` each: ``rows`` are views of one copy of the rows in use (the
        pinned buffer is written again later), the serials read in one pass (per step, a copy and a numpy scalar
        read were ~2 us of a batch-1 step's host work, 16 of them at once)."""
        buffer, steps = self._in_flight.popleft()
        host = self._host_arrays[buffer]
        stamps = host[:, self.max_reqs, 0].tolist()
        block = host[:, : max((num_trees for _, num_trees, _ in steps), default=0)].copy()
        out = []
        for serial, num_trees, tag in steps:
            slot = serial % self.slots
            if stamps[slot] != serial & _SERIAL_MASK:
                self.lost_steps += 1  # overwritten by a later serial, or never written
                continue
            out.append((tag, block[slot, :num_trees]))
        return out

    def __len__(self) -> int:
        """Steps noted and not read yet."""
        return len(self._noted) + sum(len(steps) for _, steps in self._in_flight)
