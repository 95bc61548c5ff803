"""Host cost of the CUDA event calls on ddtree's step path, with the device idle and with it busy.

    python benches/bench_event_record.py [--calls 200] [--rounds 7] [--busy-ms 2] [--json FILE]

Why: inside the engine the late trees' event record (``defer: copy``, which since ``b5124aa`` records the event only)
cost ~0.028 ms of a batch-1 step's host work on an H100 (``gpu-h100-pair-to-host-b5124aa``), against ~6 us with an
empty queue (``gpu-h100-draft-top-k-b5124aa``). This separates what an event call costs by itself from what it
costs while the device is still running earlier work (the engine's case: the host runs a step ahead).

Rows, each the median over ``--calls`` calls of one call's host wall time, rounds alternating which row runs first:

* ``record`` / ``record(stream)``: ``Event.record()`` (torch looks the current stream up) and ``Event.record(s)``
  with the stream looked up once;
* ``query``: ``Event.query()`` of an event recorded behind the work;
* each ``idle`` (the device synchronised before the call) and ``busy`` (a ``--busy-ms`` spin kernel queued before
  the call, untimed, so the call is made while the device runs it).

``busy / idle`` per call kind is the ratio of the medians, measured in the same run. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def spin_cycles(busy_ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` for about ``busy_ms`` on this device, from one timed spin."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    trial = 1_000_000
    start.record()
    torch.cuda._sleep(trial)
    end.record()
    end.synchronize()
    return max(1, int(trial * busy_ms / max(start.elapsed_time(end), 1e-3)))


def calls(stream: torch.cuda.Stream):
    event = torch.cuda.Event()
    event.record()

    def record() -> None:
        event.record()

    def record_stream() -> None:
        event.record(stream)

    def query() -> None:
        event.query()

    return {"record": record, "record(stream)": record_stream, "query": query}


def timed(call, n: int, busy_cycles: int) -> float:
    """Median host us of ``call`` over ``n`` calls; ``busy_cycles`` > 0 queues a spin kernel before each."""
    seconds = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        began = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return statistics.median(seconds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_event_record.py needs CUDA")
    busy = spin_cycles(args.busy_ms)
    kinds = calls(torch.cuda.current_stream())
    cases = [(name, state) for name in kinds for state in ("idle", "busy")]
    by_round = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for name, state in cases[:: 1 if round_index % 2 == 0 else -1]:
            by_round[(name, state)].append(timed(kinds[name], args.calls, busy if state == "busy" else 0))
    results = {"device": torch.cuda.get_device_name(), "busy_ms": args.busy_ms, "rows": []}
    print(f"{'call':>16}{'state':>7}{'host us':>10}")
    for (name, state), measured in by_round.items():
        host = statistics.median(measured)
        results["rows"].append({"call": name, "state": state, "host_us": host, "host_us_by_round": measured})
        print(f"{name:>16}{state:>7}{host:>10.2f}", flush=True)
    results["busy_over_idle"] = {}
    for name in kinds:
        idle = statistics.median(by_round[(name, "idle")])
        ratio = statistics.median(by_round[(name, "busy")]) / idle
        results["busy_over_idle"][name] = ratio
        print(f"{name:>16}  busy / idle: {ratio:.2f}", flush=True)
    if args.json:  # (one write: the whole run takes seconds)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
