"""GPU check + benchmark of the Triton tree GDN kernels at Qwen3.6-27B shapes (run on one H200).

    cd <repo> && PYTHONPATH=/tmp/site:python python3 benches/gpu_gdn_tree.py
        [--budgets 16,64,256] [--batches 1,8,32] [--check-precisions tf32x3,ieee,tf32] [--sweep-from 64]

Budgets of 2^k - 1 (``--budgets 15,16,63,64``) show what a tree of B + 1 nodes costs when B + 1 fills whole row
blocks of the kernel (16 rows) against one node into a new block.

(a) correctness: ``tree_gdn_verify`` (bf16 q/k/v, raw gates, vLLM-layout fp32 state pool read by index)
    against the fp32 torch reference ``tree_gated_delta_rule_batched`` for budgets 16/64/256 (+1 root) and
    batch 1/8, for each dot precision; the WY commit kernel against ``commit_recurrent_state``; and, when
    vLLM imports, the tree kernel on 16-node chains against vLLM's own spec-decode kernel.
(b) timing (CUDA events via ``triton.testing.do_bench``; CUDA-graph replay via ``do_bench_cudagraph``) of
    one tree verification of B + 1 nodes per request, budgets 16/64/256, batch 1/8/32, next to vLLM 0.25.1's
    ``fused_sigmoid_gating_delta_rule_update`` verifying a 16-token chain per request (its spec-decode path:
    ``cu_seqlens``, 2-D ``ssm_state_indices``, ``num_accepted_tokens``), plus a sweep of kernel block sizes.
(c) prints markdown tables and writes them with the full log to ``$OUT/gdn_tree_bench.md``.

One failing configuration prints its traceback and the run continues. Total runtime target < 5 minutes
(a deadline skips the remaining sweep entries).
"""

from __future__ import annotations

import math
import os
import time
import traceback
from pathlib import Path

from repo_kernels import import_kernels

START = time.perf_counter()
DEADLINE_S = 270.0
LOG: list = []


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def elapsed() -> float:
    return time.perf_counter() - START


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

gdn_tree, gdn_tree_triton, tree_topology = import_kernels("gdn_reference", "gdn_triton", "topology", log=log)
import triton  # noqa: E402

HK, HV, DK, DV = 16, 48, 128, 128
CHAIN_TOKENS = 16
DEVICE = "cuda"

try:
    from vllm.model_executor.layers.fla.ops.fused_sigmoid_gating import fused_sigmoid_gating_delta_rule_update

    VLLM_ERROR = None
except Exception as error:  # noqa: BLE001 - any import failure means "not measured"
    fused_sigmoid_gating_delta_rule_update = None
    VLLM_ERROR = f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def draft_like_parents(num_nodes: int, gen: torch.Generator) -> list:
    """Random topologically ordered tree with long branches (parent among the 4 previous nodes)."""
    return [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, num_nodes)]


class Problem:
    """One batch of R trees with bf16 activations, raw gates and a vLLM-layout fp32 state pool."""

    def __init__(self, trees: list, seed: int = 0, pool_slots: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.trees = trees
        sizes = [len(t) for t in trees]
        self.num_requests = len(trees)
        self.num_nodes = total = sum(sizes)
        self.offsets = torch.tensor([0] + sizes).cumsum(0)
        self.parents = torch.tensor(sum(trees, []))

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

        self.q = randn(total, HK, DK).bfloat16()
        self.k = randn(total, HK, DK).bfloat16()
        self.v = randn(total, HV, DV).bfloat16()
        self.a = randn(total, HV).bfloat16()
        self.b = randn(total, HV).bfloat16()
        self.a_log = torch.empty(HV).uniform_(-4.0, 1.0, generator=gen).to(DEVICE)
        self.dt_bias = randn(HV, scale=0.5)
        # vLLM's pool is [slots, Hv, Dv, Dk]; slot 0 is vLLM's null block. Requests read slots 1..R.
        slots = max(pool_slots, self.num_requests + 1)
        self.pool = randn(slots, HV, DV, DK, scale=0.05)
        self.slots = torch.arange(1, self.num_requests + 1, dtype=torch.int32, device=DEVICE)
        self.offsets_dev = self.offsets.to(device=DEVICE, dtype=torch.int32)
        self.bits = gdn_tree_triton.ancestor_bits_from_parents(
            self.parents.to(DEVICE), self.offsets.to(DEVICE), max_nodes=max(sizes)
        )

    def verify(self, **options):
        return gdn_tree_triton.tree_gdn_verify(
            self.q,
            self.k,
            self.v,
            self.a,
            self.b,
            self.offsets_dev,
            self.bits,
            self.pool.transpose(-1, -2),
            self.slots,
            a_log=self.a_log,
            dt_bias=self.dt_bias,
            **options,
        )

    def gates(self):
        g = -self.a_log.exp() * F.softplus(self.a.float() + self.dt_bias)
        return g, torch.sigmoid(self.b.float())

    def reference(self):
        g, beta = self.gates()
        states = self.pool[self.slots.long()].transpose(-1, -2).float()  # [R, Hv, Dk, Dv]
        return gdn_tree.tree_gated_delta_rule_batched(
            self.q.float(),
            self.k.float(),
            self.v.float(),
            g,
            beta,
            self.parents.to(DEVICE),
            self.offsets.to(DEVICE),
            states,
            return_cache=True,
        ), states


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple:
    diff = (actual.float() - expected.float()).abs().max().item()
    return diff, diff / max(expected.float().abs().max().item(), 1e-30)


# --------------------------------------------------------------------------
# (a) correctness
# --------------------------------------------------------------------------


def check_correctness(results: list, budgets=(16, 64, 256), precisions=None) -> None:
    gen = torch.Generator().manual_seed(123)
    for budget in budgets:
        for batch in (1, 8):
            try:
                trees = [draft_like_parents(budget + 1, gen) for _ in range(batch)]
                problem = Problem(trees, seed=budget + batch)
                (ref_out, cache), states = problem.reference()
                for precision in precisions or gdn_tree_triton.PRECISIONS:
                    out, deltas, cum = problem.verify(precision=precision, out_dtype=torch.float32)
                    torch.cuda.synchronize()
                    o_abs, o_rel = errors(out, ref_out)
                    u_abs, u_rel = errors(deltas, cache.deltas)
                    g_abs, _ = errors(cum, cache.cumulative_log_decay)
                    ok = o_rel <= (1e-4 if precision != "tf32" else 1e-2)
                    results.append((budget + 1, batch, precision, o_abs, o_rel, u_abs, u_rel, g_abs, ok))
                    log(
                        f"check nodes={budget + 1} batch={batch} {precision:6s}: o max abs {o_abs:.2e} rel {o_rel:.2e}"
                        f" | u abs {u_abs:.2e} rel {u_rel:.2e} | G abs {g_abs:.2e} -> {'OK' if ok else 'FAIL'}"
                    )
                check_commit(problem, cache, states)
            except Exception:  # noqa: BLE001
                log(f"check nodes={budget + 1} batch={batch}: EXCEPTION")
                log(traceback.format_exc())


def check_commit(problem: Problem, cache, states) -> None:
    """Accept the root path of each tree's last node; commit into fresh slots; compare with the reference."""
    _, deltas, cum = problem.verify()
    paths = [tree_topology.root_path(torch.tensor(t), len(t) - 1) for t in problem.trees]
    padded, lengths = gdn_tree_triton.pad_accepted_paths(paths, device=DEVICE)
    pool = torch.zeros(problem.num_requests, HV, DV, DK, device=DEVICE)
    destination = torch.arange(problem.num_requests, dtype=torch.int32, device=DEVICE)
    gdn_tree_triton.tree_gdn_commit(
        problem.k,
        deltas,
        cum,
        problem.offsets_dev,
        padded,
        lengths,
        problem.pool.transpose(-1, -2),
        problem.slots,
        destination,
        pool.transpose(-1, -2),
    )
    worst = 0.0
    for request, path in enumerate(paths):
        expected = gdn_tree.commit_recurrent_state(cache.request(request), path, states[request])
        worst = max(worst, errors(pool[request].transpose(-1, -2), expected)[1])
    log(
        f"  commit (path length {max(len(p) for p in paths)}): max rel error {worst:.2e} "
        f"-> {'OK' if worst <= 1e-4 else 'FAIL'}"
    )


def vllm_chain_inputs(problem_chain: Problem):
    """vLLM spec-decode arguments for a batch of 16-token chains: every token gets its own state slot."""
    batch = problem_chain.num_requests
    tokens = CHAIN_TOKENS
    # Slots 1 + r * tokens + t; slot 0 is vLLM's null block (skipped by the kernel).
    indices = (1 + torch.arange(batch * tokens, device=DEVICE, dtype=torch.int32)).reshape(batch, tokens)
    cu_seqlens = torch.arange(0, (batch + 1) * tokens, tokens, device=DEVICE, dtype=torch.int32)
    accepted = torch.ones(batch, dtype=torch.int32, device=DEVICE)  # initial state = indices[:, 0]
    return indices, cu_seqlens, accepted


def check_against_vllm() -> None:
    """Tree kernel on chain trees == vLLM's chain kernel (same gates, l2norm, scale, state layout)."""
    if fused_sigmoid_gating_delta_rule_update is None:
        log(f"vLLM cross-check skipped: vLLM import failed ({VLLM_ERROR})")
        return
    for batch in (1, 8):
        try:
            chains = [[-1] + list(range(CHAIN_TOKENS - 1)) for _ in range(batch)]
            problem = Problem(chains, seed=7 + batch, pool_slots=1 + batch * CHAIN_TOKENS)
            indices, cu_seqlens, accepted = vllm_chain_inputs(problem)
            problem.pool[indices[:, 0].long()] = problem.pool[problem.slots.long()]
            problem.slots = indices[:, 0].contiguous()
            tree_out, _, _ = problem.verify(out_dtype=torch.float32)
            pool = problem.pool.clone()
            vllm_out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=problem.a_log,
                a=problem.a,
                b=problem.b,
                dt_bias=problem.dt_bias,
                # fp32 copies of the bf16 values: vLLM then writes fp32 outputs and the comparison is tight.
                q=problem.q.float()[None],
                k=problem.k.float()[None],
                v=problem.v.float()[None],
                initial_state=pool,
                inplace_final_state=True,
                cu_seqlens=cu_seqlens,
                ssm_state_indices=indices,
                num_accepted_tokens=accepted,
                use_qk_l2norm_in_kernel=True,
            )
            torch.cuda.synchronize()
            vllm_out = vllm_out.reshape(tree_out.shape)
            o_abs, o_rel = errors(vllm_out, tree_out)
            log(
                f"vs vLLM chain kernel, batch {batch} x {CHAIN_TOKENS} tokens: o max abs {o_abs:.2e} rel {o_rel:.2e}"
                f" -> {'OK' if o_rel <= 1e-4 else 'FAIL'}"
            )
        except Exception:  # noqa: BLE001
            log(f"vLLM cross-check batch {batch}: EXCEPTION")
            log(traceback.format_exc())


# --------------------------------------------------------------------------
# (b) timing
# --------------------------------------------------------------------------


def bench_us(fn, graph: bool = True) -> tuple:
    """(eager us, CUDA-graph us); NaN where a method fails."""
    fn()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3
    replay = float("nan")
    if graph:
        try:
            replay = triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3
        except Exception as error:  # noqa: BLE001
            log(f"  (CUDA-graph timing failed: {type(error).__name__}: {error})")
    return eager, replay


SWEEP = [
    dict(block_t=16, block_c=64, block_v=32),
    dict(block_t=16, block_c=64, block_v=64),
    dict(block_t=16, block_c=64, block_v=128),
    dict(block_t=16, block_c=64, block_v=128, num_warps=8),
    dict(block_t=32, block_c=64, block_v=64),
    dict(block_t=16, block_c=32, block_v=64),
    dict(block_t=16, block_c=32, block_v=128),
    dict(block_t=16, block_c=64, block_v=64, num_warps=8),
    # ptxas (compiled for sm_90a on a CPU, 27B shape): the default (4 warps, 2 stages) spills ~200 B a thread at
    # block_v 64 and ~1.2 KB at 128; with 8 warps and 1 or 3 stages nothing spills at 64.
    dict(block_t=16, block_c=64, block_v=64, num_warps=8, num_stages=3),
    dict(block_t=16, block_c=32, block_v=64, num_warps=8, num_stages=3),
    dict(block_t=16, block_c=64, block_v=128, num_warps=8, num_stages=3),
    dict(block_t=16, block_c=64, block_v=64, block_kc=64),
    dict(precision="tf32"),
    dict(precision="ieee"),
]


def describe(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items()) or "default"


def run_timings(main_rows: list, sweep_rows: list, budgets=(16, 64, 256), batches=(1, 8, 32), sweep_from=64) -> None:
    gen = torch.Generator().manual_seed(5)
    for budget in budgets:
        for batch in batches:
            label = f"budget {budget} (+1) x batch {batch}"
            row = {"budget": budget, "batch": batch}
            try:
                trees = [draft_like_parents(budget + 1, gen) for _ in range(batch)]
                problem = Problem(trees, seed=batch)
                block_v = gdn_tree_triton._default_block_v(batch * HV, DV)
                row["default"] = f"BC={gdn_tree_triton.DEFAULT_BLOCK_C} BV={block_v}"
                row["verify"] = bench_us(lambda: problem.verify())
                _, deltas, cum = problem.verify()
                paths = [tree_topology.root_path(torch.tensor(t), len(t) - 1) for t in trees]
                padded, lengths = gdn_tree_triton.pad_accepted_paths(paths, device=DEVICE)
                destination = problem.slots.clone()
                row["commit"] = bench_us(
                    lambda: gdn_tree_triton.tree_gdn_commit(
                        problem.k,
                        deltas,
                        cum,
                        problem.offsets_dev,
                        padded,
                        lengths,
                        problem.pool.transpose(-1, -2),
                        problem.slots,
                        destination,
                    )
                )
                row["bits"] = bench_us(
                    lambda: gdn_tree_triton.ancestor_bits_from_parents(
                        problem.parents.to(DEVICE), problem.offsets.to(DEVICE), max_nodes=budget + 1
                    ),
                    graph=False,
                )
                log(
                    f"time {label}: verify {row['verify'][0]:.1f} us eager / {row['verify'][1]:.1f} us graph "
                    f"({row['default']}), commit {row['commit'][1]:.1f} us graph, ancestor bits {row['bits'][0]:.1f} us"
                )
            except Exception:  # noqa: BLE001
                log(f"time {label}: EXCEPTION")
                log(traceback.format_exc())
            row["vllm"] = time_vllm(batch)
            main_rows.append(row)
            if budget >= sweep_from and "verify" in row:
                for options in SWEEP:
                    if elapsed() > DEADLINE_S:
                        log(f"  sweep {describe(options)}: skipped (time budget)")
                        continue
                    try:
                        times = bench_us(lambda: problem.verify(**options))
                        sweep_rows.append((budget + 1, batch, describe(options), times))
                        log(f"  sweep {describe(options)}: {times[0]:.1f} us eager / {times[1]:.1f} us graph")
                    except Exception:  # noqa: BLE001
                        log(f"  sweep {describe(options)}: EXCEPTION")
                        log(traceback.format_exc())


def time_vllm(batch: int):
    if fused_sigmoid_gating_delta_rule_update is None:
        return None
    try:
        chains = [[-1] + list(range(CHAIN_TOKENS - 1)) for _ in range(batch)]
        problem = Problem(chains, seed=11, pool_slots=1 + batch * CHAIN_TOKENS)
        indices, cu_seqlens, accepted = vllm_chain_inputs(problem)
        q, k, v = problem.q[None], problem.k[None], problem.v[None]

        def run():
            return fused_sigmoid_gating_delta_rule_update(
                A_log=problem.a_log,
                a=problem.a,
                b=problem.b,
                dt_bias=problem.dt_bias,
                q=q,
                k=k,
                v=v,
                initial_state=problem.pool,
                inplace_final_state=True,
                cu_seqlens=cu_seqlens,
                ssm_state_indices=indices,
                num_accepted_tokens=accepted,
                use_qk_l2norm_in_kernel=True,
            )

        times = bench_us(run)
        log(f"time vLLM chain {CHAIN_TOKENS} tokens x batch {batch}: {times[0]:.1f} us eager / {times[1]:.1f} us graph")
        return times
    except Exception:  # noqa: BLE001
        log(f"time vLLM chain batch {batch}: EXCEPTION")
        log(traceback.format_exc())
        return None


# --------------------------------------------------------------------------
# (c) report
# --------------------------------------------------------------------------


def fmt(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def report(check_rows: list, main_rows: list, sweep_rows: list) -> str:
    lines = [
        "# Tree GDN verification on GPU",
        "",
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        f"shapes Hk={HK} Hv={HV} Dk={DK} Dv={DV}; q/k/v bf16, raw gates, fp32 state pool (vLLM layout).",
        "vLLM kernel: "
        + ("measured" if fused_sigmoid_gating_delta_rule_update is not None else f"NOT measured ({VLLM_ERROR})"),
        "",
        "## (a) errors vs the fp32 torch reference",
        "",
        "| nodes | batch | precision | o max abs | o max rel | u max abs | u max rel | G max abs | ok |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for nodes, batch, precision, o_abs, o_rel, u_abs, u_rel, g_abs, ok in check_rows:
        lines.append(
            f"| {nodes} | {batch} | {precision} | {o_abs:.2e} | {o_rel:.2e} | {u_abs:.2e} | {u_rel:.2e} "
            f"| {g_abs:.2e} | {'yes' if ok else 'NO'} |"
        )
    lines += [
        "",
        "## (b) one tree verification (B + 1 nodes per request) vs vLLM's chain verification (16 tokens)",
        "",
        "Times in microseconds per GDN layer call (eager = CUDA events around Python launches, "
        "graph = CUDA-graph replay). Tree kernel at default settings (tf32x3, BT=16, "
        f"BC={gdn_tree_triton.DEFAULT_BLOCK_C}, BKC=32, 4 warps, BV by heuristic: 64, 128 from "
        f"{gdn_tree_triton.WIDE_BLOCK_V_FROM} request-heads on).",
        "",
        "| budget | batch | tree verify eager | tree verify graph | tree commit graph | ancestor bits eager "
        "| vLLM chain-16 eager | vLLM chain-16 graph | tree/vLLM (graph) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in main_rows:
        verify = row.get("verify", (None, None))
        commit = row.get("commit", (None, None))
        bits = row.get("bits", (None, None))
        vllm = row.get("vllm") or (None, None)
        ratio = verify[1] / vllm[1] if verify[1] and vllm[1] and not math.isnan(verify[1] + vllm[1]) else None
        lines.append(
            f"| {row['budget']} | {row['batch']} | {fmt(verify[0])} | {fmt(verify[1])} | {fmt(commit[1])} "
            f"| {fmt(bits[0])} | {fmt(vllm[0])} | {fmt(vllm[1])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    lines += [
        "",
        "## kernel option sweep (tree verify)",
        "",
        "| nodes | batch | options | eager us | graph us |",
        "|---:|---:|---|---:|---:|",
    ]
    for nodes, batch, options, (eager, graph) in sweep_rows:
        lines.append(f"| {nodes} | {batch} | {options} | {fmt(eager)} | {fmt(graph)} |")
    return "\n".join(lines)


def parse_args(argv=None):
    import argparse

    def numbers(text: str) -> tuple:
        return tuple(int(x) for x in text.split(",") if x)

    ap = argparse.ArgumentParser(description="tree GDN kernels at Qwen3.6-27B shapes (GPU)")
    ap.add_argument("--budgets", type=numbers, default=(16, 64, 256), help="draft nodes per tree (B; B + 1 nodes)")
    ap.add_argument("--batches", type=numbers, default=(1, 8, 32))
    ap.add_argument(
        "--check-precisions",
        default=",".join(gdn_tree_triton.PRECISIONS),
        help="dot precisions checked against the fp32 reference (timing uses the default, tf32x3)",
    )
    ap.add_argument("--sweep-from", type=int, default=64, help="budgets from this one on get the option sweep")
    args = ap.parse_args(argv)
    unknown = [p for p in args.check_precisions.split(",") if p not in gdn_tree_triton.PRECISIONS]
    if unknown:
        ap.error(f"--check-precisions: unknown {unknown}; known: {list(gdn_tree_triton.PRECISIONS)}")
    if not args.budgets or min(args.budgets) < 1 or not args.batches or min(args.batches) < 1:
        ap.error("--budgets and --batches must be positive integers")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to do")
        return
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if VLLM_ERROR:
        log(f"vLLM import failed: {VLLM_ERROR} -- vLLM's kernel will not be measured")
    check_rows, main_rows, sweep_rows = [], [], []
    log("== (a) correctness ==")
    check_correctness(check_rows, args.budgets, args.check_precisions.split(","))
    check_against_vllm()
    log(f"== (b) timing == (elapsed {elapsed():.0f} s)")
    run_timings(main_rows, sweep_rows, args.budgets, args.batches, args.sweep_from)
    table = report(check_rows, main_rows, sweep_rows)
    log("")
    log(table)
    log(f"\ntotal {elapsed():.0f} s")
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gdn_tree_bench.md"
    path.write_text(table + "\n\n## full log\n\n```\n" + "\n".join(LOG) + "\n```\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
