"""``ddtree_budget: "auto"`` through the pair bench's traffic in a simulated world, on CPU: what it runs, and what
that costs against the best fixed budget of the same world.

    python benches/bench_auto_traffic.py [--rounds 4] [--seed 0] [--lengths 28 36] [--ring 4] [--lazy-graphs]
        [--settle-steps N] [--json FILE]

The traffic is ``bench_vllm_ddtree.py``'s: per round, 32 requests one at a time, then in groups of 8, then all 32
together, each request ~32 verify steps (its length drawn per request from ``--lengths``, so a group ends in a tail
of shrinking batch sizes), an untimed gap (a prefill) before every group. The default, 28-35 steps, keeps a batch of
32 whole for ~28 steps; on the H200 the pair's batch of 32 stayed whole for 10-14 steps a run
(``gpu-h200-pair-38e16ce``'s step trace), which ``--lengths 12 50`` (the same mean) comes closer to. Each step runs
the budget ``AutoBudget.lookup`` gives its batch size, through the real :class:`~ddtree.vllm.auto_budget.StepTimer`
on a simulated clock, and its trees accept paths drawn from a fixed mix, which reach the policy four steps at a time
(``--ring``), as the runner's statistics ring delivers them; each step's batch size reaches it as the step runs
(``note_step``).

The world (not a measurement of any GPU): a step's period is ``fixed + per_request * n + per_token * n * (c + 1)``
ms, times a +-10% jitter, with ``n`` requests of budget ``c``. The defaults make a host-bound pair-like engine where a
larger tree is nearly free at one request and dear at 32; the accepted paths' draft numbers double at every depth, so
each doubling of the budget keeps a little less than the last (acceptance lengths 4.0 / 4.375 / 4.625 / 4.75 for
budgets 15 / 31 / 63 / 127, printed first; the test pair's are 3.5-4.4).

Printed per batch size and round: the probes opened, the steps run at each budget, and the simulated tokens per
millisecond of ``auto`` over the best fixed budget's on the same steps (the world's noise-free expectation:
acceptance length over period). A policy change shows here first, before a GPU run.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ddtree.vllm import auto_budget
from ddtree.vllm.auto_budget import AutoBudget, StepTimer

CANDIDATES = (15, 31, 63, 127)
#: Accepted paths (draft numbers in pop order) and how often a tree accepts each prefix length.
PATH = np.array([1, 2, 4, 9, 20, 45, 100, 220])
ACCEPTED = np.array([1, 2, 2, 3, 4, 5, 6, 7])


def tau(budget: int) -> float:
    """The world's mean acceptance length of a budget (bonus token included)."""
    kept = [(PATH[:a] <= budget).sum() for a in ACCEPTED]
    return 1.0 + float(np.mean(kept))


def simulate(
    rounds: int,
    seed: int,
    fixed: float,
    per_request: float,
    per_token: float,
    lazy_graphs: bool = False,
    lengths: tuple = (28, 36),
    ring: int = 4,
) -> list:
    """``lengths``: each request's verify steps are drawn from ``[lo, hi)``. ``ring``: the steps whose acceptance
    reaches the policy together (the runner's statistics ring: four; 1, every step as it runs). ``lazy_graphs``:
    the first step of each (budget, batch size) captures its graphs and is left out of the
    timing, as the runner leaves out a step that ran a graph for the first time (its GDN commit graphs are captured
    at a size's first step unless ``DDTREE_PRECAPTURE=all``)."""
    rng = np.random.default_rng(seed)
    captured = set()
    landing: list = []
    auto = AutoBudget(CANDIDATES, 32)
    clock = [0.0]
    timer = StepTimer(clock=lambda: clock[0])

    def period(budget: int, n: int) -> float:
        return fixed + per_request * n + per_token * n * (budget + 1)

    def step(n: int, used: dict) -> None:
        budget = auto.budget_for(n)
        used[budget] = used.get(budget, 0) + 1
        timer.start()
        first_run = lazy_graphs and (budget, n) not in captured
        captured.add((budget, n))
        timer.finish(None if first_run else (budget, n))
        for (b, trees), ms in timer.landed():
            auto.observe_step_time(b, trees, ms)
        clock[0] += period(budget, n) * rng.uniform(0.9, 1.1) / 1e3
        accepted = rng.choice(ACCEPTED, size=n)
        landing.append((np.full(n, budget), np.ones(n, dtype=bool), np.tile(PATH, (n, 1)), accepted))
        if len(landing) == ring:  # as the runner's statistics ring lands: four steps' acceptance at once
            for observed in landing:
                auto.observe(*observed)
            landing.clear()
        auto.note_step(n)
        auto.maybe_decide()

    rows = []
    for round_ in range(rounds):
        for batch in (1, 8, 32):
            used: dict = {}
            probes = auto.probes
            tokens = ms = 0.0
            shapes = []  # every step's batch size, for the fixed budgets' rates on the same traffic
            for _ in range(32 // batch):
                timer.start()
                timer.finish(None)  # the group's prefill: not a timed verify step
                steps_of = rng.integers(*lengths, size=batch)  # each request's verify steps
                for s in range(int(steps_of.max())):
                    n = int((steps_of > s).sum())
                    budget = auto.budget_for(n)
                    tokens += n * tau(budget)
                    ms += period(budget, n)
                    shapes.append(n)
                    step(n, used)
            fixed_rate = {c: sum(n * tau(c) for n in shapes) / sum(period(c, n) for n in shapes) for c in CANDIDATES}
            best = max(fixed_rate, key=fixed_rate.get)
            rows.append(
                {
                    "round": round_,
                    "batch": batch,
                    "probes": auto.probes - probes,
                    "steps_by_budget": dict(sorted(used.items())),
                    "best_fixed_budget": best,
                    # Tokens per ms as auto ran the run over the best fixed budget's on the same steps: the world's
                    # expectation (acceptance length over the noise-free period).
                    "ratio_to_best_fixed": (tokens / ms) / fixed_rate[best],
                }
            )
    rows.append(
        {
            "lookup": auto.describe(),
            **{k: auto.summary()[k] for k in ("period_ratios", "octave_budgets")},
            "first_run_steps": len(captured) if lazy_graphs else 0,  # steps left out as captures
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-ms", type=float, default=6.0)
    ap.add_argument("--per-request-ms", type=float, default=0.2)
    ap.add_argument("--per-token-ms", type=float, default=0.0025)
    ap.add_argument(
        "--lazy-graphs",
        action="store_true",
        help="the first step of each (budget, batch size) captures graphs and is left out of the timing",
    )
    ap.add_argument("--lengths", type=int, nargs=2, default=(28, 36), metavar=("LO", "HI"))
    ap.add_argument("--ring", type=int, default=4, help="steps whose acceptance reaches the policy together")
    ap.add_argument(
        "--settle-steps",
        type=int,
        default=auto_budget.SETTLE_STEPS,
        help="auto_budget.SETTLE_STEPS for this run (0: probes open at window closes only, the policy before it)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    auto_budget.SETTLE_STEPS = args.settle_steps if args.settle_steps > 0 else 10**9
    print("acceptance length by budget:", {c: tau(c) for c in CANDIDATES})
    rows = simulate(
        args.rounds,
        args.seed,
        args.fixed_ms,
        args.per_request_ms,
        args.per_token_ms,
        lazy_graphs=args.lazy_graphs,
        lengths=tuple(args.lengths),
        ring=args.ring,
    )
    for row in rows[:-1]:
        print(
            f"round {row['round']} batch {row['batch']:2d}: probes {row['probes']}, steps by budget "
            f"{row['steps_by_budget']}, best fixed {row['best_fixed_budget']}, "
            f"auto / best fixed {row['ratio_to_best_fixed']:.3f}"
        )
    print(rows[-1]["lookup"])
    print("period ratios:", rows[-1]["period_ratios"], "octave budgets:", rows[-1]["octave_budgets"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
