"""GPU micro-benchmark of the paged tree-attention kernel: single pass against split-KV (run on one GPU).

    cd <repo> && python3 benches/bench_tree_attention.py --out $OUT/tree_attention.md

For every context in {128, 512, 1024, 4096, 16384} x batch {1, 8, 32}, each sequence verifies one random
draft tree of 64 nodes plus its root (65 query rows) over a paged bf16 KV cache (block size 16, shuffled
block table) with Qwen3-ish heads (32 query heads, 8 KV heads, head size 128):

(a) the single pass (``num_kv_splits=1``, the kernel as it was before split-KV) and the default path
    (split count from ``choose_num_kv_splits`` with the host-side ``max_seq_len``, what vLLM now runs)
    are timed in the same run, and their outputs compared (bf16 tolerance); at batch 1 both are also
    compared with the fp32 torch oracle;
(b) a sweep of forced split counts, to show where the heuristic's choice sits;
(c) one row at the shape of the tiny Qwen3 of ``benches/results/gpu-vllm-tiny-qwen3-*`` (4 heads, 2 KV
    heads, head 64, a 16-node tree at a 1004-token prompt).

Timing: CUDA events around each call, L2 flushed before each call (a layer's K/V is not in L2 in a real
forward), warm-up calls first (compilation included there), median of ``--reps``. Prints markdown tables and
writes them with the full log to ``--out`` (raw numbers to ``--out`` + ``.json``). Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from repo_kernels import import_kernels

DEVICE = "cuda"
LOG: list = []


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def random_parents(n, rng):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]  # pop order: parents first


def ancestor_bits(parents_list, np):
    """Stacked ancestor-or-self rows ``[sum n, words]`` (uint32 viewed as int32) and each tree's first row."""
    words = max(1, max((len(p) + 31) // 32 for p in parents_list))
    rows, starts, r = [], [], 0
    for parents in parents_list:
        n = len(parents)
        bits = np.zeros((n, words), dtype=np.uint32)
        for i in range(n):
            j = i
            while j >= 0:
                bits[i, j // 32] |= np.uint32(1 << (j % 32))
                j = parents[j]
        rows.append(bits)
        starts.append(r)
        r += n
    return np.concatenate(rows).view(np.int32), starts


def make_inputs(torch, np, batch, ctx, tree_nodes, num_heads, num_kv_heads, head_size, page, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_len = tree_nodes + 1
    seq_len = ctx + q_len
    blocks_per_seq = -(-seq_len // page)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    block_table = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    # vLLM's layout: one [num_blocks, 2, page, H, D] tensor per layer, K and V its unbind(1).
    kv = torch.randn(num_blocks, 2, page, num_kv_heads, head_size, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    key_cache, value_cache = kv.unbind(1)
    query = torch.randn(batch * q_len, num_heads, head_size, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    bits, starts = ancestor_bits([random_parents(q_len, rng) for _ in range(batch)], np)
    return (
        dict(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=block_table,
            query_start_loc=torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * q_len,
            seq_lens=torch.full((batch,), seq_len, device=DEVICE, dtype=torch.int32),
            row_start=torch.tensor(starts, device=DEVICE, dtype=torch.int32),
            ancestor_bits=torch.from_numpy(bits).to(DEVICE),
            scale=head_size**-0.5,
        ),
        q_len,
        seq_len,
    )


class Timer:
    def __init__(self, torch, warmup, reps):
        self.torch, self.warmup, self.reps = torch, warmup, reps
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=DEVICE)  # > H200's 50 MB L2

    def __call__(self, fn) -> float:
        """Median microseconds of ``fn()`` over ``reps`` calls, each after an L2 flush."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="log file (markdown); raw numbers go to OUT.json")
    parser.add_argument("--contexts", default="128,512,1024,4096,16384")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tree-nodes", type=int, default=64, help="draft nodes per tree (plus the root)")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", default="1,2,4,8,16,32,64", help="forced split counts for table (b); '' skips")
    parser.add_argument(
        "--block-m",
        default="16,32,64",
        help="rows per program for table (d), at Qwen3.6-27B's attention heads (24 q / 4 KV / head 256); '' skips",
    )
    parser.add_argument("--only-d", action="store_true", help="table (d) alone")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        message = (
            "bench_tree_attention.py needs a CUDA GPU (torch with CUDA and Triton); "
            + ("torch is not installed" if torch is None else "torch.cuda.is_available() is False")
            + ". Nothing was measured."
        )
        print(message, file=sys.stderr)
        out.write_text(message + "\n")
        return 2
    import numpy as np
    import triton

    pta, reference = import_kernels("paged_attention_triton", "paged_attention_reference", log=log)
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    log(f"# paged tree attention: single pass vs split-KV ({props.name}, {props.multi_processor_count} SMs)")
    log(f"torch {torch.__version__}, triton {triton.__version__}, kernel {pta.__file__}")
    log(
        f"heuristic: {pta._SPLIT_PROGRAMS_PER_SM} programs/SM target, >= {pta._MIN_KEYS_PER_SPLIT} keys per split, "
        f"<= {pta._MAX_SPLITS} splits; reps {args.reps} (median), warm-up {args.warmup}, L2 flushed per call"
    )
    timer = Timer(torch, args.warmup, args.reps)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    sweep = [int(x) for x in args.sweep.split(",") if x]
    records, failures = [], []

    def run_shape(label, batch, ctx, tree_nodes, heads, kv_heads, head_size, page=16):
        inputs, q_len, seq_len = make_inputs(
            torch, np, batch, ctx, tree_nodes, heads, kv_heads, head_size, page, seed=batch * 100003 + ctx
        )
        common = dict(inputs, max_query_len=q_len)
        splits = pta.choose_num_kv_splits(batch, q_len, heads, kv_heads, seq_len, props.multi_processor_count)
        out_single = torch.empty_like(inputs["query"])
        out_split = torch.empty_like(inputs["query"])

        def single():
            pta.paged_tree_attention(**common, out=out_single, num_kv_splits=1)

        def default():
            pta.paged_tree_attention(**common, out=out_split, max_seq_len=seq_len)

        t_single = timer(single)
        t_split = timer(default)
        diff = (out_single.float() - out_split.float()).abs().max().item()
        ok = torch.allclose(out_single.float(), out_split.float(), atol=2e-2, rtol=2e-2)
        ref_diff = None
        if batch == 1:
            on_cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in inputs.items()}
            want = reference.paged_tree_attention_reference(**on_cpu).float().to(DEVICE)
            ref_diff = max((o.float() - want).abs().max().item() for o in (out_single, out_split))
            ok = ok and ref_diff < 3e-2
        if not ok:
            failures.append(f"{label} ctx={ctx} batch={batch}: max |split - single| {diff:.3g}, vs oracle {ref_diff}")
        rec = dict(
            label=label,
            ctx=ctx,
            batch=batch,
            q_rows=q_len,
            seq_len=seq_len,
            heads=heads,
            kv_heads=kv_heads,
            head_size=head_size,
            splits=splits,
            single_us=t_single,
            split_us=t_split,
            speedup=t_single / t_split,
            max_diff=diff,
            oracle_diff=ref_diff,
            ok=ok,
            sweep={},
        )
        for n in sweep if label == "qwen3" else []:

            def forced(n=n):
                pta.paged_tree_attention(**common, out=out_split, num_kv_splits=n)

            rec["sweep"][n] = timer(forced)
        records.append(rec)
        return rec

    def block_sweep(ctx, batch):
        """Default rows per program, then each of ``--block-m``: times, and the largest output difference."""
        inputs, q_len, seq_len = make_inputs(
            torch, np, batch, ctx, args.tree_nodes, 24, 4, 256, 16, seed=batch * 7919 + ctx
        )
        common = dict(inputs, max_query_len=q_len, max_seq_len=seq_len)
        want = torch.empty_like(inputs["query"])
        got = torch.empty_like(inputs["query"])
        times = [timer(lambda: pta.paged_tree_attention(**common, out=want))]
        diff = 0.0
        for m in block_ms:
            times.append(timer(lambda m=m: pta.paged_tree_attention(**common, out=got, block_m=m)))
            diff = max(diff, (got.float() - want.float()).abs().max().item())
        if diff > 2e-2:
            failures.append(f"block sweep ctx={ctx} batch={batch}: max diff {diff:.3g}")
        records.append(dict(label="block-sweep", ctx=ctx, batch=batch, block_m=block_ms, us=times, max_diff=diff))
        torch.cuda.empty_cache()
        return times, diff

    if args.only_d:
        contexts, batches, sweep = [], [], []
    log("")
    log(
        "## (a) single pass vs default (split-KV) path, 32 q heads / 8 KV heads / head 128, bf16, block 16, "
        f"trees of {args.tree_nodes} nodes + root"
    )
    log("")
    log(
        "| context | batch | q rows | splits | single pass us | split-KV us | speed-up (single/split) | max diff | ok |"
    )
    log("|---:|---:|---:|---:|---:|---:|---:|---:|:--|")
    for ctx in contexts:
        for batch in batches:
            try:
                r = run_shape("qwen3", batch, ctx, args.tree_nodes, 32, 8, 128)
                torch.cuda.empty_cache()  # this shape's cache goes before the next one's is allocated
            except Exception as error:  # noqa: BLE001 - one failing shape must not hide the others
                failures.append(f"qwen3 ctx={ctx} batch={batch}: {type(error).__name__}: {error}")
                log(f"| {ctx} | {batch} | - | - | - | - | - | - | ERROR {type(error).__name__}: {error} |")
                continue
            log(
                f"| {ctx} | {batch} | {r['q_rows']} | {r['splits']} | {r['single_us']:.1f} | {r['split_us']:.1f} | "
                f"{r['speedup']:.2f}x | {r['max_diff']:.2e} | {'yes' if r['ok'] else 'NO'} |"
            )

    if sweep:
        log("")
        log("## (b) forced split counts (us; * = the heuristic's choice, best in bold)")
        log("")
        log("| context | batch | " + " | ".join(f"{n}" for n in sweep) + " |")
        log("|---:|---:|" + "---:|" * len(sweep))
        for r in records:
            if not r["sweep"]:
                continue
            best = min(r["sweep"].values())
            cells = []
            for n in sweep:
                t = r["sweep"][n]
                cell = f"{t:.1f}" + ("*" if n == r["splits"] else "")
                cells.append(f"**{cell}**" if t == best else cell)
            log(f"| {r['ctx']} | {r['batch']} | " + " | ".join(cells) + " |")

    if not args.only_d:
        log("")
        log("## (c) the tiny Qwen3 of the vLLM runs: 4 q heads / 2 KV heads / head 64, 16-node tree, 1004-token prompt")
        log("")
        try:
            r = run_shape("tiny-qwen3", 1, 1004, 16, 4, 2, 64)
            log(
                f"batch 1, {r['seq_len']} keys: single pass {r['single_us']:.1f} us, split-KV ({r['splits']} splits) "
                f"{r['split_us']:.1f} us, speed-up {r['speedup']:.2f}x, max diff {r['max_diff']:.2e}, "
                f"ok {'yes' if r['ok'] else 'NO'} (per attention layer and step)"
            )
        except Exception as error:  # noqa: BLE001
            failures.append(f"tiny-qwen3: {type(error).__name__}: {error}")
            log(f"tiny-qwen3: ERROR {type(error).__name__}: {error}")

    block_ms = [int(x) for x in args.block_m.split(",") if x]
    if block_ms:
        log("")
        log(
            "## (d) rows per program at Qwen3.6-27B's attention heads (24 q / 4 KV / head 256), trees of "
            f"{args.tree_nodes} nodes + root, split count by the heuristic for each (us; default first)"
        )
        log("")
        log("| context | batch | default | " + " | ".join(f"block_m {m}" for m in block_ms) + " | max diff |")
        log("|---:|---:|---:|" + "---:|" * len(block_ms) + "---:|")
        for ctx in (512, 2048, 8192):
            for batch in (1, 8):
                try:
                    cells, diff = block_sweep(ctx, batch)
                except Exception as error:  # noqa: BLE001 - one failing shape must not hide the others
                    failures.append(f"block sweep ctx={ctx} batch={batch}: {type(error).__name__}: {error}")
                    log(f"| {ctx} | {batch} | ERROR {type(error).__name__}: {error} |")
                    continue
                log(f"| {ctx} | {batch} | " + " | ".join(f"{t:.1f}" for t in cells) + f" | {diff:.2e} |")

    log("")
    log(f"total {time.perf_counter() - start:.0f} s; " + ("ALL-AGREE" if not failures else "MISMATCH:"))
    for f in failures:
        log("  " + f)
    out.write_text("\n".join(LOG) + "\n")
    Path(str(out) + ".json").write_text(json.dumps(records, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
