"""The tree build on the device (``ddtree.kernels.device_tree``) against the Rust core on the host.

    python benches/bench_device_tree.py [--batches 1 8 32] [--budgets 63 127] [--depth 15] [--top-k 64]
        [--build-warps 4 1] [--json FILE]

Per batch size and budget, from a drafter-like top-K ``[R, L, K]`` (bf16 logits over a 4096-token vocabulary, the
test pair's) already on the device:

* ``host``: what the runner does today: the top-K copied to the host (waited for) and ``ddtree.build_trees``.
* ``device``: ``device_tree.build_trees`` launched eagerly, to completion.
* ``graph`` (CUDA only): the same captured once as a CUDA graph and replayed (its host cost is one replay launch).
* ``triton`` (CUDA only): ``tree_build_triton.build_trees_triton``, the whole search in one launch, to completion.
* ``host plan`` / ``triton plan`` (CUDA only): the build and a whole-tree step's verification layout (ancestor bits,
  conv windows of 3, node arrays): on the host the copy, ``ddtree.build_trees`` and ``ddtree.verify_layout_into``
  into numpy arrays; on the device ``build_trees_triton`` then ``tree_layout_triton.whole_tree_layout``.
* ``plan graph wN`` (CUDA only, one per ``--build-warps`` N): the same build and layout into fixed tensors, captured
  as one CUDA graph and replayed, the build kernel with N warps a program: the GPU work ``DDTREE_DEVICE_PLAN`` adds
  to a step (without its placement copies), its output checked against the core's trees first.

Each figure is the median of ``--steps`` timed runs, wall clock, synchronised at the end of each. Every build is
compared with the core's trees (parents, depths, tokens) first: a mismatch stops the bench. On a machine without
CUDA the device is the CPU and there is no graph row. Rows are printed and written (``--json``) as they are measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

import ddtree
from ddtree.kernels.device_tree import build_trees
from ddtree.kernels.tree_build_triton import build_trees_triton
from ddtree.kernels.tree_layout_triton import whole_tree_layout


def drafter_top_k(num_reqs: int, depth: int, top_k: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_reqs, depth, 4096, generator=gen) * 3.0).to(torch.bfloat16).float()
    values, ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
    return values.to(device), ids.to(torch.int32).to(device)


def timed(run, steps: int, sync) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def check(trees, log_probs, token_ids, budget: int) -> None:
    core = ddtree.build_trees(log_probs.cpu().numpy(), token_ids.cpu().numpy(), budget)
    size = budget + 1
    same = np.array_equal(trees.parents.cpu().numpy(), core.parents.astype(np.int64).reshape(-1, size))
    same = same and np.array_equal(trees.depths.cpu().numpy(), core.depths.astype(np.int64).reshape(-1, size))
    same = same and np.array_equal(trees.tokens[:, 1:].cpu().numpy(), core.tokens.reshape(-1, budget))
    if not same:
        raise SystemExit(f"the device trees differ from the core's (budget {budget}, {log_probs.shape[0]} requests)")


def measure(
    num_reqs: int, budget: int, depth: int, top_k: int, steps: int, device: torch.device, build_warps=(4,)
) -> dict:
    log_probs, token_ids = drafter_top_k(num_reqs, depth, top_k, device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    check(build_trees(log_probs, token_ids, budget), log_probs, token_ids, budget)

    def host():
        lp, ids = log_probs.cpu().numpy(), token_ids.cpu().numpy()  # waits for the device, as settle() does
        ddtree.build_trees(lp, ids, budget)  # one thread, as the runner's store builds them

    row = {
        "batch": num_reqs,
        "budget": budget,
        "host_ms": timed(host, steps, sync),
        "device_ms": timed(lambda: build_trees(log_probs, token_ids, budget), steps, sync),
    }
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            build_trees(log_probs, token_ids, budget)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = build_trees(log_probs, token_ids, budget)
        graph.replay()
        sync()
        check(captured, log_probs, token_ids, budget)
        row["graph_ms"] = timed(graph.replay, steps, sync)
        check(build_trees_triton(log_probs, token_ids, budget), log_probs, token_ids, budget)
        row["triton_ms"] = timed(lambda: build_trees_triton(log_probs, token_ids, budget), steps, sync)
        row["host_plan_ms"], row["triton_plan_ms"] = time_plans(log_probs, token_ids, budget, steps, sync)
        for warps in build_warps:
            row[f"plan_graph_w{warps}_ms"] = time_plan_graph(log_probs, token_ids, budget, steps, sync, warps)
    return row


def time_plan_graph(log_probs, token_ids, budget: int, steps: int, sync, warps: int) -> float:
    """ms per replay of one CUDA graph of the build (``warps`` a program) and the layout into fixed tensors, after
    its trees are checked against the core's."""
    work, scratch = plan_work(log_probs, token_ids, budget, warps)
    work()  # (compiles)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    scratch.parents.zero_()
    graph.replay()
    sync()
    check(scratch, log_probs, token_ids, budget)
    return timed(graph.replay, steps, sync)


def plan_work(log_probs, token_ids, budget: int, warps: int):
    """The device plan's two launches into fixed tensors (no allocation: capturable), and the trees' scratch."""
    from ddtree.kernels.device_tree import DeviceTrees
    from ddtree.kernels.tree_layout_triton import KERNEL_OUTPUTS, whole_tree_layout_into

    num_reqs, depth, _ = log_probs.shape
    size, device = budget + 1, log_probs.device
    total, words = num_reqs * size, -(-size // 32)

    def new(shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)

    scratch = DeviceTrees(new((num_reqs, size)), new((num_reqs, size)), new((num_reqs, size)),
                          new((num_reqs, size), torch.float64), new((num_reqs, size)))  # fmt: skip
    out = {name: new(total) for name in KERNEL_OUTPUTS}
    out.update(ancestor_bits=new((total, words), torch.int32), conv_index=new((total, CONV_WINDOW + 1)),
               draft_step_index=new(total - num_reqs), draft_tokens=new(total - num_reqs, torch.int32))  # fmt: skip
    starts = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    query_starts = torch.arange(num_reqs, dtype=torch.int64, device=device) * size

    def work():
        trees = build_trees_triton(log_probs, token_ids, budget, out=scratch, num_warps=warps)
        whole_tree_layout_into(trees.parents, trees.depths, trees.tokens, starts, query_starts, query_starts,
                               words=words, window=CONV_WINDOW, max_depth=depth, out=out)  # fmt: skip

    return work, scratch


#: The GDN conv window of the plans' layout (Qwen3.5/3.6's ``conv_kernel_size - 1``).
CONV_WINDOW = 3


def time_plans(log_probs, token_ids, budget: int, steps: int, sync):
    """(host ms, device ms) of a whole-tree step's build and layout (the placement of ``R`` whole trees in order)."""
    num_reqs, depth, _ = log_probs.shape
    size = budget + 1
    words = -(-size // 32)
    placement = np.arange(num_reqs, dtype=np.int64)
    query_starts = placement * size
    host_out = {
        "token_index": np.empty(num_reqs * size, np.int64),
        "logit_rows": np.empty(num_reqs * size, np.int64),
        "positions": np.empty(num_reqs * size, np.int64),
        "ancestor_bits": np.empty((num_reqs * size, words), np.int32),
        "row_start": np.empty(num_reqs, np.int32),
        "node_offsets": np.empty(num_reqs + 1, np.int32),
        "conv_index": np.empty((num_reqs * size, CONV_WINDOW + 1), np.int64),
    }

    def host():
        batch = ddtree.build_trees(log_probs.cpu().numpy(), token_ids.cpu().numpy(), budget)
        ddtree.verify_layout_into(batch, placement, placement, query_starts, query_starts, **host_out)

    device_placement = [torch.from_numpy(a).to(log_probs.device) for a in (placement, placement, query_starts)]

    def device():
        trees = build_trees_triton(log_probs, token_ids, budget)
        whole_tree_layout(
            trees.parents,
            trees.depths,
            trees.tokens,
            *device_placement,
            device_placement[2],
            num_rows=num_reqs,
            words=words,
            window=CONV_WINDOW,
            max_depth=depth,
        )

    return timed(host, steps, sync), timed(device, steps, sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[63, 127])
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", help="write the rows here, after each")
    parser.add_argument(
        "--build-warps", type=int, nargs="+", default=[4], help="warps a build program, one plan-graph row each"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"{name}, torch {torch.__version__}, L={args.depth}, K={args.top_k}", flush=True)
    rows = []
    for budget in args.budgets:
        for num_reqs in args.batches:
            row = measure(num_reqs, budget, args.depth, args.top_k, args.steps, device, args.build_warps)
            rows.append(row)
            graph = f", graph {row['graph_ms']:.3f} ms" if "graph_ms" in row else ""
            graph += f", triton {row['triton_ms']:.3f} ms" if "triton_ms" in row else ""
            if "triton_plan_ms" in row:
                graph += f"; plan: host {row['host_plan_ms']:.3f} ms, triton {row['triton_plan_ms']:.3f} ms"
                graph += "".join(f", graph w{w} {row[f'plan_graph_w{w}_ms']:.3f} ms" for w in args.build_warps)
            print(
                f"budget {budget:4d} batch {num_reqs:3d}: host {row['host_ms']:.3f} ms, device "
                f"{row['device_ms']:.3f} ms{graph} (trees equal to the core's)",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": name, "argv": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
