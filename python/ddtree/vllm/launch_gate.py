"""A device-side gate: the GPU stream waits for a host counter, so a step's forward can be queued before its trees
exist.

Under asynchronous scheduling a tree step's trees are built on the host once the drafter's top-K has landed; the
forward, its input copy and its placement used to be queued only after that, so the GPU idled through the tree
build and the host work that followed it (``docs/async-scheduling.md``, "Launching the forward before the trees
exist"). With a gate the runner queues ``wait(ticket)``, the staging copy, the placement and vLLM's forward while
the GPU still runs the step before, builds the trees into the pinned staging buffer, and then :meth:`StreamGate.release`
writes the ticket: the stream proceeds, and its copy reads the trees written after it was queued.

The wait is ``cuStreamWaitValue32`` (a driver stream memory operation, called through ctypes) on a pinned 32-bit
counter: ``CU_STREAM_WAIT_VALUE_GEQ`` compares ``(int32)(counter - ticket) >= 0``, so tickets only grow and never
need a reset. On an H200 it was exact in 20 of 20 gated copies, and released ~0.05 ms after the host's write
(``benches/gpu_launch_gate.py``; a Triton spin kernel on the same flag missed once in 20).

A stream wait has no time limit: were the host to wait for the GPU between queueing a gate and releasing it, both
would wait for ever. :class:`Watchdog` releases a ticket held longer than ``timeout_s`` and the runner's release
then raises, naming the cause, instead of the engine hanging.

Torch and ctypes only (no vLLM import); CI tests it on CPU with a stand-in driver call.
"""

from __future__ import annotations

import ctypes
import platform
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

#: Hosts whose store order the release relies on (``platform.machine()``, lower case).
X86_64 = ("x86_64", "amd64")
#: ``CU_STREAM_WAIT_VALUE_GEQ``: wait until ``(int32_t)(*addr - value) >= 0``.
WAIT_GEQ = 0x0
#: Seconds a queued ticket may wait for its release before the watchdog releases it (a step's host work between
#: the two is milliseconds; only a wait for the GPU inside that window, a bug, takes this long).
DEFAULT_TIMEOUT_S = 20.0

#: ``wait(stream_handle, device_address, value, flags) -> CUresult``.
WaitFn = Callable[[int, int, int, int], int]


class GateTimeout(RuntimeError):
    """A ticket was released by the watchdog, not by the host: the step's inputs were not written in time."""


def driver_wait() -> WaitFn:
    """``cuStreamWaitValue32`` from the CUDA driver (``libcuda.so.1``), as a Python callable."""
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def wait(stream: int, address: int, value: int, flags: int) -> int:
        return fn(ctypes.c_void_p(stream), ctypes.c_uint64(address), ctypes.c_uint32(value), flags)

    return wait


class StreamGate:
    """A pinned counter that CUDA streams wait on; tickets are queued in order and released in order.

    ``wait`` is the driver call (:func:`driver_wait` on a GPU; tests pass a stand-in). ``stream`` handles are
    ``torch.cuda.Stream.cuda_stream`` values.
    """

    def __init__(self, device: torch.device, wait: Optional[WaitFn] = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        # On a GPU with unified addressing a pinned host address is also its device address.
        self._counter = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._counter_np: np.ndarray = self._counter.numpy().view(np.uint32)
        self._wait = wait if wait is not None else driver_wait()
        self._queued = 0  # the last ticket handed out (tickets are 1, 2, ... modulo 2**32)
        self._lock = threading.Lock()  # the host's release and the watchdog's write one ticket once
        self._watchdog = Watchdog(self, timeout_s)

    @property
    def released(self) -> int:
        """The counter's value: the last ticket released."""
        return int(self._counter_np[0])

    def queue(self, stream: Optional[int] = None) -> int:
        """Queues a wait for the next ticket on ``stream`` (default: the device's current stream) and returns the
        ticket; the stream's later work runs after :meth:`release` of that ticket."""
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        ticket = (self._queued + 1) & 0xFFFFFFFF
        result = self._wait(stream, self._counter.data_ptr(), ticket, WAIT_GEQ)
        if result != 0:
            raise RuntimeError(f"DDTree: cuStreamWaitValue32 failed (CUresult {result}) queueing a launch gate")
        self._queued = ticket
        self._watchdog.arm(ticket)
        return ticket

    def release(self, ticket: int) -> None:
        """Lets the streams waiting for ``ticket`` go. Raises :class:`GateTimeout` if the watchdog had to."""
        fired = self._watchdog.disarm(ticket)
        self._write(ticket)
        if fired:
            raise GateTimeout(
                f"DDTree: the GPU waited over {self._watchdog.timeout_s:.0f} s for a step's trees; the watchdog let it "
                "go, so that step ran on stale inputs. Something waited for the GPU between the early launch and the "
                "trees (a bug); DDTREE_LAUNCH_AHEAD=0 turns the early launch off."
            )

    def _write(self, ticket: int) -> None:
        with self._lock:
            # Tickets only grow (modulo 2**32): never write an older one over a newer release.
            if ((ticket - int(self._counter_np[0])) & 0xFFFFFFFF) < 0x80000000:
                # Stores reach memory in program order (x86-64; the staging data was written before this line).
                self._counter_np[0] = ticket


class Watchdog:
    """Releases a queued ticket after ``timeout_s`` if the host has not (a daemon thread, started at the first
    ticket; one timed wait per ticket, no wake-up per step)."""

    def __init__(self, gate: StreamGate, timeout_s: float):
        self.gate, self.timeout_s = gate, timeout_s
        self._cond = threading.Condition()
        self._armed: Optional[tuple] = None  # (ticket, deadline)
        self._fired: set = set()
        self._thread: Optional[threading.Thread] = None

    def arm(self, ticket: int) -> None:
        with self._cond:
            self._armed = (ticket, time.monotonic() + self.timeout_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ddtree-gate-watchdog", daemon=True)
                self._thread.start()

    def disarm(self, ticket: int) -> bool:
        """Whether the watchdog released ``ticket`` already."""
        with self._cond:
            if self._armed is not None and self._armed[0] == ticket:
                self._armed = None
            if ticket in self._fired:
                self._fired.discard(ticket)
                return True
            return False

    def _run(self) -> None:
        with self._cond:
            while True:
                armed = self._armed
                if armed is None:
                    self._cond.wait(1.0)  # arm() does not notify: one idle wake-up a second costs nothing
                    continue
                left = armed[1] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed = None
                self._fired.add(armed[0])
                self.gate._write(armed[0])


def probe(device: torch.device) -> Optional[str]:
    """Why a launch gate cannot work on ``device`` (None: it can): a gate whose ticket is already released is
    queued on the current stream and must pass."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if platform.machine().lower() not in X86_64:
        # The release (``StreamGate._write``) is a plain store after the plan's stores; only x86-64's store order
        # makes the GPU see them first. Elsewhere (aarch64: GH200) it would need a release fence.
        return f"the gate's release relies on x86-64's store order; this host is {platform.machine()}"
    try:
        wait = driver_wait()
    except (OSError, AttributeError) as exc:
        return f"the CUDA driver's cuStreamWaitValue32 is not available ({exc})"
    counter = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    result = wait(torch.cuda.current_stream(device).cuda_stream, counter.data_ptr(), 0, WAIT_GEQ)
    if result != 0:
        return f"cuStreamWaitValue32 returned CUresult {result} (stream memory operations unsupported?)"
    torch.cuda.current_stream(device).synchronize()
    return None
