"""Host cost of the CUDA event calls on ddtree's step path, with the device idle and with it busy.

    python benches/bench_event_record.py [--calls 200] [--rounds 7] [--busy-ms 2] [--json FILE]

Why: inside the engine the late trees' event record (``defer: copy``, which since ``b5124aa`` records the event only)
cost ~0.028 ms of a batch-1 step's host work on an H100 (``gpu-h100-pair-to-host-b5124aa``), against ~6 us with an
empty queue (``gpu-h100-draft-top-k-b5124aa``). This separates what an event call costs by itself from what it
costs while the device is still running earlier work (the engine's case: the host runs a step ahead).

Rows, each the median over ``--calls`` calls of one call's host wall time, rounds alternating which row runs first:

* ``record`` / ``record(stream)``: ``Event.record()`` (torch looks the current stream up) and ``Event.record(s)``
  with the stream looked up once;
* ``query``: ``Event.query()`` of an event recorded (untimed) just before: behind the spin when the device is
  busy, so still pending, as the statistics ring's copy often is when the engine queries it;
* each ``idle`` (the device synchronised before the call), ``busy`` (a ``--busy-ms`` spin kernel queued before
  the call, untimed, so the call is made while the device runs it) and ``deep`` (the same spin, then ``--deep``
  tiny kernels queued behind it, untimed: the call is made with a long launch queue, which the driver bounds; a
  launch into a full queue waits for the device).

``busy / idle`` and ``deep / idle`` per call kind are ratios of the medians, measured in the same run. CUDA only.
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
    """``{name: (untimed setup or None, timed call)}``."""
    event = torch.cuda.Event()
    event.record()
    return {
        "record": (None, lambda: event.record()),
        "record(stream)": (None, lambda: event.record(stream)),
        "query": (lambda: event.record(), lambda: event.query()),
    }


def timed(kind, n: int, busy_cycles: int, deep: int = 0) -> float:
    """Median host us of ``kind``'s call over ``n`` calls; ``busy_cycles`` > 0 queues a spin kernel before each,
    and ``deep`` tiny spin kernels behind it, then its setup runs (untimed)."""
    setup, call = kind
    seconds = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        for _ in range(deep):
            torch.cuda._sleep(1)
        if setup is not None:
            setup()
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
    parser.add_argument("--deep", type=int, default=1200, help="tiny kernels queued behind the spin (deep state)")
    parser.add_argument("--deep-calls", type=int, default=20, help="calls per round in the deep state (slow to set)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_event_record.py needs CUDA")
    busy = spin_cycles(args.busy_ms)
    setups = {"idle": (args.calls, 0, 0), "busy": (args.calls, busy, 0), "deep": (args.deep_calls, 4 * busy, args.deep)}
    kinds = calls(torch.cuda.current_stream())
    cases = [(name, state) for name in kinds for state in setups]
    by_round = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for name, state in cases[:: 1 if round_index % 2 == 0 else -1]:
            by_round[(name, state)].append(timed(kinds[name], *setups[state]))
    results = {"device": torch.cuda.get_device_name(), "busy_ms": args.busy_ms, "deep": args.deep, "rows": []}
    print(f"{'call':>16}{'state':>7}{'host us':>10}")
    for (name, state), measured in by_round.items():
        host = statistics.median(measured)
        results["rows"].append({"call": name, "state": state, "host_us": host, "host_us_by_round": measured})
        print(f"{name:>16}{state:>7}{host:>10.2f}", flush=True)
    for state in ("busy", "deep"):
        results[f"{state}_over_idle"] = {}
        for name in kinds:
            ratio = statistics.median(by_round[(name, state)]) / statistics.median(by_round[(name, "idle")])
            results[f"{state}_over_idle"][name] = ratio
            print(f"{name:>16}  {state} / idle: {ratio:.2f}", flush=True)
    if args.json:  # (one write: the whole run takes seconds)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
