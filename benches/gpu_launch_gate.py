"""Can a tree step launch its forward before its trees exist? Three measurements on one GPU (torch and Triton only).

    python3 benches/gpu_launch_gate.py [--nodes 500,1000,2000,4000] [--out DIR]

Why: on a Qwen3.6-27B-shape profile (``benches/results/gpu-h200-27b-shape-768591a``) the first kernel of every
FULL verification ran ~4 ms after its forward's range began, when ``cudaGraphLaunch`` returned, and the GPU had
been idle since the drafter finished: ddtree builds a step's trees on the host after the drafter's top-K lands, so
the graph's launch cannot overlap GPU work the way vLLM's chain's does. The remedy designed in
``docs/async-scheduling.md`` ("Launching the forward before the trees exist") queues the launch early, behind a device-side wait for a host flag. This
script measures what that rests on:

(a) **graph launch**: host time of ``CUDAGraph.replay()`` for graphs of N small kernels, and how much of it the GPU
    waits through when idle (elapsed GPU time from an event before the replay to one after it, idle GPU against a
    GPU kept busy by a sleep kernel queued first: the difference is the exposed launch).
(b) **gate correctness**: a wait on a pinned host flag, then a copy from a pinned staging buffer, then a kernel
    reading the copy, all queued before the host writes the staging data and then the flag; the kernel must see
    the data written after the queueing. Two gates: ``cuStreamWaitValue32`` (driver stream memory operation, through
    ctypes) and a one-program Triton kernel spinning on volatile loads of the flag (bounded by a time limit that
    sets an error word instead of hanging).
(c) **gate latency**: host flag write to the end of a small kernel after the gate, against the same kernel queued
    without a gate (wall time to ``synchronize``), and a gated 2000-node graph against the same graph replayed
    after the data is ready.

Prints a report and writes it to ``$OUT/launch_gate.md`` (or ``--out``). A failing part prints its traceback and
the rest runs. Needs a CUDA GPU; exits with a message otherwise. Runtime ~1 minute; run it under ``timeout``
(an unbounded gate that never sees its flag would hang the stream).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
import traceback

LOG: list = []


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def small_graph(torch, nodes: int):
    """A CUDA graph of ``nodes`` tiny kernels (in-place adds on a 256-element tensor) and the tensor it updates."""
    x = torch.zeros(256, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the capture, as torch recommends
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1.0)
    torch.cuda.synchronize()
    return graph, x


def measure_graph_launch(torch, nodes: int, reps: int = 30) -> dict:
    """Median host ms of ``replay()``, and GPU ms from an event before it to one after, idle and busy GPU."""
    graph, _ = small_graph(torch, nodes)
    host, idle, busy = [], [], []
    for busy_gpu in (False, True):
        for _ in range(reps):
            torch.cuda.synchronize()
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if busy_gpu:
                torch.cuda._sleep(20_000_000)  # ~10 ms of a busy SM: the launch happens while the GPU works
            before.record()
            started = time.perf_counter()
            graph.replay()
            launched = time.perf_counter()
            after.record()
            torch.cuda.synchronize()
            (busy if busy_gpu else idle).append(before.elapsed_time(after))
            if not busy_gpu:
                host.append(1e3 * (launched - started))
    return {
        "nodes": nodes,
        "replay_host_ms": statistics.median(host),
        "gpu_ms_idle_launch": statistics.median(idle),
        "gpu_ms_busy_launch": statistics.median(busy),
    }


class StreamWaitValue:
    """``cuStreamWaitValue32`` through ctypes: the stream waits until a 32-bit word in mapped pinned memory is
    >= a value (``CU_STREAM_WAIT_VALUE_GEQ``)."""

    GEQ = 0x0

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        fn = getattr(self.cuda, "cuStreamWaitValue32_v2", None) or self.cuda.cuStreamWaitValue32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        self.fn = fn

    def wait(self, torch, flag, value: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        result = self.fn(ctypes.c_void_p(stream), ctypes.c_uint64(flag.data_ptr()), value, self.GEQ)
        if result != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {result}")


class _Pointer:
    """A pinned tensor as a Triton pointer argument (on a unified-address GPU the host address works on the GPU)."""

    def __init__(self, tensor):
        self.tensor, self.dtype = tensor, tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def spin_kernel():
    """The Triton gate: one program spinning on volatile loads of a 32-bit flag until it reaches ``value``, or
    until ``limit_ns`` of the GPU's global timer have passed (then it sets ``error_ptr[0]`` and lets the stream go)."""
    import triton
    import triton.language as tl

    @triton.jit
    def spin_until(flag_ptr, value, error_ptr, limit_ns):
        start = tl.extra.cuda.globaltimer()
        seen = tl.load(flag_ptr, volatile=True)
        waited = start - start  # an int64 zero: a loop-carried variable keeps its first type
        while (seen < value) & (waited < limit_ns):
            seen = tl.load(flag_ptr, volatile=True)
            waited = tl.extra.cuda.globaltimer() - start
        if seen < value:
            tl.store(error_ptr, 1)

    return spin_until


def triton_spin_gate():
    spin_until = spin_kernel()

    def wait(torch, flag, value: int, error, limit_ms: float = 2000.0) -> None:
        spin_until[(1,)](_Pointer(flag), value, error, int(limit_ms * 1e6))

    return wait


def gated_copy(torch, gate, name: str, delay_s: float = 0.005) -> dict:
    """(b) and (c) for one gate: correctness of data written after queueing, and flag-to-done wall time."""
    staging = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    target = torch.zeros(4096, dtype=torch.int64, device="cuda")
    total = torch.zeros(1, dtype=torch.int64, device="cuda")
    checks, latencies = [], []
    for step in range(1, 21):
        torch.cuda.synchronize()
        gate(torch, flag, step)
        target.copy_(staging, non_blocking=True)
        torch.sum(target, dim=0, keepdim=True, out=total)
        time.sleep(delay_s)  # the host "builds the trees" while the GPU waits at the gate
        staging.copy_(torch.arange(4096, dtype=torch.int64) * step)
        released = time.perf_counter()
        flag[0] = step
        torch.cuda.synchronize()
        latencies.append(1e3 * (time.perf_counter() - released))
        checks.append(int(total.item()) == step * 4095 * 4096 // 2)
    # The same copy and kernel queued once the data is ready (no gate): the floor of the latency above.
    floor = []
    for _ in range(20):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(staging, non_blocking=True)
        torch.sum(target, dim=0, keepdim=True, out=total)
        torch.cuda.synchronize()
        floor.append(1e3 * (time.perf_counter() - started))
    return {
        "gate": name,
        "correct_steps": sum(checks),
        "of": len(checks),
        "flag_to_done_ms": statistics.median(latencies),
        "ungated_ms": statistics.median(floor),
    }


def gated_graph(torch, gate, name: str, nodes: int = 2000) -> dict:
    """(c) for a graph: queue gate + replay before the host's work, release, against replay after it."""
    graph, _ = small_graph(torch, nodes)
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    early, late = [], []
    for step in range(1, 16):
        torch.cuda.synchronize()
        gate(torch, flag, step)
        graph.replay()
        time.sleep(0.005)
        released = time.perf_counter()
        flag[0] = step
        torch.cuda.synchronize()
        early.append(1e3 * (time.perf_counter() - released))
        time.sleep(0.005)
        started = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        late.append(1e3 * (time.perf_counter() - started))
    return {
        "gate": name,
        "nodes": nodes,
        "gated_release_to_done_ms": statistics.median(early),
        "launch_after_ready_to_done_ms": statistics.median(late),
    }


def for_each_gate(torch, gates, measure, row: str) -> None:
    """One table row per gate: ``measure(torch, gate, name)``'s result formatted by ``row`` (a failure: its
    traceback, and the next gate runs)."""
    for name, gate in gates:
        try:
            log(f"| {name} | " + row.format(**measure(torch, gate, name)) + " |")
        except Exception:
            log(traceback.format_exc())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="500,1000,2000,4000", help="kernels per graph for (a)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/launch_gate"))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_launch_gate.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    log("\n## (a) graph launch: host ms of replay(), GPU ms from an event before it to one after (median)\n")
    log("| kernels | replay host ms | GPU ms, idle GPU | GPU ms, busy GPU | exposed launch ms |")
    log("|---:|---:|---:|---:|---:|")
    for nodes in (int(n) for n in args.nodes.split(",")):
        try:
            r = measure_graph_launch(torch, nodes)
            exposed = r["gpu_ms_idle_launch"] - r["gpu_ms_busy_launch"]
            log(
                f"| {nodes} | {r['replay_host_ms']:.3f} | {r['gpu_ms_idle_launch']:.3f} | "
                f"{r['gpu_ms_busy_launch']:.3f} | {exposed:.3f} |"
            )
        except Exception:
            log(traceback.format_exc())
    # The bounded gate first: a gate that never sees the flag hangs the stream (cuStreamWaitValue32 has no bound),
    # so run this script under `timeout`.
    gates = []
    try:
        spin = triton_spin_gate()
        error = torch.zeros(1, dtype=torch.int32, device="cuda")
        gates.append(("Triton spin", lambda t, flag, value: spin(t, flag, value, error)))
    except Exception:
        log(traceback.format_exc())
    try:
        waiter = StreamWaitValue()
        gates.append(("cuStreamWaitValue32", lambda t, flag, value: waiter.wait(t, flag, value)))
    except Exception:
        log(traceback.format_exc())
    log("\n## (b, c) gates: data written after queueing, flag write to done (ms, median of 20)\n")
    log("| gate | correct steps | flag to done ms | same work ungated ms |\n|---|---:|---:|---:|")
    for_each_gate(torch, gates, gated_copy, "{correct_steps}/{of} | {flag_to_done_ms:.3f} | {ungated_ms:.3f}")
    if gates and "error" in locals() and int(error.item()):
        log("Triton spin: its time limit passed at least once (the flag was not seen)")
    log("\n## (c) a gated 2000-kernel graph: release to done, against launching it once ready (ms, median)\n")
    log("| gate | gated, release to done | launched after ready, launch to done |\n|---|---:|---:|")
    for_each_gate(torch, gates, gated_graph, "{gated_release_to_done_ms:.3f} | {launch_after_ready_to_done_ms:.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_gate.md"), "w") as handle:
        handle.write("# Launch gate measurements\n\n" + "\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
