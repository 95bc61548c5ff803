"""GPU check of the step graphs (``ddtree.vllm.graphs``: the walk graphs and a plan's placement), without vLLM.

    python3 tests/gpu/walk_graphs_check.py [--out DIR]

For random steps (trees cut by a scheduler or whole, with and without a GDN conv window, 1 to 32 trees), the walk
through ``WalkGraphs`` with real CUDA-graph capture must equal ``accept_on_device`` run op by op on the same
inputs, field by field, for the walk that captures and for replays on new target tokens; a step with a prefill
before its trees, walked by one graph over a fixed token budget whatever the prefill's length
(``DDTREE_MIXED_WALK_GRAPHS``), must equal the same walk op by op over the step's own tokens. It also times the host
side of one walk both ways in the same run (median microseconds over repeats). Then a plan's placement as the
runner does it for a whole-tree step (``runner._ddtree_place_plan``: the layout from a pinned staging upload into
the fixed buffers, the positions written in place), replayed through ``ShapeGraphs`` on each new step's upload,
must equal the same placement op by op: the upload's views must sit at the captured addresses. Then the GDN
commit after a replayed walk, read in place by a commit graph, must leave the layers' states equal to the commit
run op by op on copies of the same paths. Prints one line
per case and a verdict; writes ``walk_graphs_check.json`` to ``--out``. Needs torch with CUDA and the ddtree wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from ddtree.kernels.kv_moves import apply_kv_moves_indexed, kv_move_index
from ddtree.vllm import device_accept
from ddtree.vllm.gdn import GdnCommitPlan, PendingCommit, commit_layer
from ddtree.vllm.graphs import CommitGraphs, ShapeGraphs, TreeStepBuffers, WalkGraphs, cuda_graph_capture
from ddtree.vllm.staging import StepStaging
from ddtree.vllm.step import TreeStore, plan_verify


def make_step(rng, num_trees, depth, width, budget, conv_window, cut, arrays=None):
    """A verification plan of ``num_trees`` trees (each a request of its own), some cut when ``cut``."""
    store = TreeStore(budget=budget)
    req_ids = [f"r{i}" for i in range(num_trees)]
    logits = rng.normal(size=(num_trees, depth, 40)) * 2.0
    ids = np.argsort(-logits, axis=-1)[..., :width]
    log_probs = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), ids, axis=-1)
    lists = store.propose(req_ids, log_probs.astype(np.float32), ids.astype(np.int64))
    scheduled = {
        r: lists[i][: int(rng.integers(1, len(lists[i]) + 1))] if cut else lists[i] for i, r in enumerate(req_ids)
    }
    num_scheduled = np.array([len(scheduled[r]) + 1 for r in req_ids])
    computed = np.arange(num_trees, dtype=np.int64) * 100 + 9
    extra = {} if arrays is None else dict(arrays=arrays, words=3)
    return plan_verify(store, req_ids, computed, num_scheduled, scheduled, conv_window=conv_window, **extra)


def on_device(plan, device) -> device_accept.DeviceTrees:
    arrays = device_accept.node_arrays(plan.trees)
    tensors = {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}
    return device_accept.DeviceTrees(
        **tensors,
        node_offsets=torch.from_numpy(np.asarray(plan.trees.node_offsets, dtype=np.int64)).to(device),
        query_starts=torch.from_numpy(plan.query_starts.astype(np.int64)).to(device),
        token_index=torch.from_numpy(plan.token_index.astype(np.int64)).to(device),
        ancestor_bits=torch.from_numpy(plan.ancestor_bits).to(device),
    )


def targets(rng, plan, device):
    """Node tokens that often agree with the drafts (deep acceptance sometimes), else misses."""
    out = np.empty(plan.num_tree_tokens, dtype=np.int64)
    for j in range(plan.batch_index.shape[0]):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        tokens = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        out[lo:hi] = rng.choice(np.concatenate([tokens, [999]]), size=hi - lo)
    return torch.from_numpy(out).to(device)


def host_us(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def check_case(rng, device, num_trees, depth, width, budget, conv_window, cut) -> dict:
    plan = make_step(rng, num_trees, depth, width, budget, conv_window, cut)
    trees = on_device(plan, device)
    args = (depth + 2, int(plan.trees.draft_depth) + 1, plan.num_tokens, conv_window)
    graphs = WalkGraphs(cuda_graph_capture(device))
    mismatches = []
    for round_ in range(4):  # round 0 captures, the others replay
        target = targets(rng, plan, device)
        got = graphs.walk(trees, target, *args)
        got = {k: v.clone() for k, v in got.items()}  # the next replay rewrites them
        want = device_accept.accept_on_device(trees, target, *args)
        mismatches += [f"round {round_} {k}" for k in want if not torch.equal(got[k], want[k])]
    torch.cuda.synchronize()
    target = targets(rng, plan, device)
    eager = host_us(lambda: device_accept.accept_on_device(trees, target, *args))
    graph = host_us(lambda: graphs.walk(trees, target, *args))
    return walk_result(plan, graphs, mismatches, eager, graph, conv_window=conv_window, cut=cut)


def walk_result(plan, graphs, mismatches, eager_us, graph_us, **case) -> dict:
    """One walk case's line: its trees, what it was, the graph's replays, the mismatches and both host times."""
    return dict(
        trees=int(plan.batch_index.shape[0]),
        nodes=int(plan.num_tree_tokens),
        **case,
        replays=graphs.replayed,
        mismatches=mismatches,
        host_us_op_by_op=round(eager_us, 1),
        host_us_graph=round(graph_us, 1),
    )


def check_mixed_case(rng, device, num_trees, depth, width, budget, conv_window, token_budget=8192) -> dict:
    """A step with a prefill before its whole trees (not a FULL graph's; ``DDTREE_MIXED_WALK_GRAPHS``): the walk
    graph over the scheduler's ``token_budget`` must equal the walk op by op over the step's own tokens (the
    drafter's row order: its first ``num_tokens`` rows), for prefills of several lengths, all replaying one graph
    (the trees' tensors rewritten in place, as the staging upload's views are). Times the host side both ways."""
    plan = make_step(rng, num_trees, depth, width, budget, conv_window, cut=False)
    trees = on_device(plan, device)
    index, starts = trees.token_index.clone(), trees.query_starts.clone()
    walk = (depth + 2, int(plan.trees.draft_depth) + 1)
    graphs = WalkGraphs(cuda_graph_capture(device))
    mismatches = []
    for round_, prefill in enumerate((5, 37, 300, 5)):  # round 0 captures, the others replay
        trees.token_index.copy_(index + prefill)
        trees.query_starts.copy_(starts + prefill)
        num_tokens = plan.num_tokens + prefill
        target = targets(rng, plan, device)
        got = {k: v.clone() for k, v in graphs.walk(trees, target, *walk, token_budget, conv_window).items()}
        got["context_order"] = got["context_order"][:num_tokens]
        want = device_accept.accept_on_device(trees, target, *walk, num_tokens, conv_window)
        mismatches += [f"round {round_} {k}" for k in want if not torch.equal(got[k], want[k])]
    torch.cuda.synchronize()
    target = targets(rng, plan, device)
    eager = host_us(lambda: device_accept.accept_on_device(trees, target, *walk, num_tokens, conv_window))
    graph = host_us(lambda: graphs.walk(trees, target, *walk, token_budget, conv_window))
    case = dict(mixed_step=True, conv_window=conv_window, token_budget=token_budget)
    return walk_result(plan, graphs, mismatches, eager, graph, **case)


def place(buffers, positions, gpu, total):
    """The runner's placement of a synchronous whole-tree step (``runner._ddtree_place_plan``), on its own buffers."""
    buffers.load(gpu["row_start"], gpu["ancestor_bits"], gpu["node_offsets"], gpu["conv_index"])
    placed = {"flat_positions": positions[:total].clone()}
    positions[gpu["token_index"]] = gpu["positions"]
    return placed


def check_placement(rng, device, num_trees: int, rounds: int = 6) -> dict:
    """Whole trees of budget 64 each round (the same shapes, new trees and starts), placed through ShapeGraphs and
    op by op; both sides' buffers compared after every round."""
    staging = StepStaging(device)
    graphed = (TreeStepBuffers(device, 32, 32 * 65, 65, 4), torch.zeros(4096, dtype=torch.int64, device=device))
    eager = (TreeStepBuffers(device, 32, 32 * 65, 65, 4), torch.zeros(4096, dtype=torch.int64, device=device))
    graphs, total, mismatches = ShapeGraphs(cuda_graph_capture(device)), num_trees * 65, []
    for round_ in range(rounds):
        plan = make_step(rng, num_trees, 15, 8, 64, 3, False, arrays=staging.host_arrays)
        gpu = staging.upload_host()
        for side in (graphed, eager):
            side[1][:total] = torch.arange(total, device=device) + 1000 * round_  # vLLM's flat positions
        key = (staging.layout_key(), total)
        got = graphs.run(key, lambda: place(graphed[0], graphed[1], gpu, total))
        want = place(eager[0], eager[1], gpu, total)
        same = torch.equal(got["flat_positions"], want["flat_positions"]) and torch.equal(graphed[1], eager[1])
        same = same and all(
            torch.equal(getattr(graphed[0], n), getattr(eager[0], n))
            for n in ("row_start", "ancestor_bits", "node_offsets", "conv_index")
        )
        if not same or plan.num_tree_tokens != total:
            mismatches.append(f"round {round_}")
    return dict(case="placement", trees=num_trees, replays=graphs.replayed, mismatches=mismatches)


def random_pending(gen, device, num_slots, num_nodes, channels=64, heads=(2, 4), dims=(32, 32), window=3):
    """One GDN layer's commit inputs, as its verification records them (random values, the layers' dtypes)."""
    (hk, hv), (dk, dv) = heads, dims
    normal = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    return PendingCommit(
        conv_state=normal(num_slots, channels, window, dtype=torch.bfloat16),
        ssm_state=normal(num_slots, hv, dk, dv),
        slots=torch.arange(num_slots - 1, -1, -1, device=device, dtype=torch.int32)[: num_slots // 2],
        x=normal(num_nodes, channels, dtype=torch.bfloat16),
        k=normal(num_nodes, hk, dk, dtype=torch.bfloat16),
        deltas=normal(num_nodes, hv, dv),
        cum_log_decay=-torch.rand(num_nodes, hv, generator=gen, device=device).cumsum(0) * 0.01,
    )


def check_commit_in_place(rng, device, num_trees: int, rounds: int = 5) -> dict:
    """The GDN commit after a replayed walk, through ``CommitGraphs.commit(in_place=True)`` (a graph keyed by the
    walk graph's output addresses, reading them there, with the step's K/V moves in it), against ``commit_layer``
    and the moves run op by op on copies of the same paths; both sides' conv and recurrent states and K/V caches
    start equal and are compared after every round. Each round the
    layers' recorded inputs are rewritten in place (as a FULL graph's replay does) and the walk sees new targets."""
    plan = make_step(rng, num_trees, 15, 8, 64, 3, False)
    trees = on_device(plan, device)
    args = (17, int(plan.trees.draft_depth) + 1, plan.num_tokens, 3)
    walks, commits = (
        WalkGraphs(cuda_graph_capture(device)),
        CommitGraphs(device, 32, args[1], 3, cuda_graph_capture(device)),
    )
    gen = torch.Generator(device=device).manual_seed(num_trees)
    layers = {f"layer.{i}": random_pending(gen, device, 2 * num_trees, plan.num_tree_tokens) for i in range(2)}
    reference = {name: PendingCommit(**{**vars(p), "conv_state": p.conv_state.clone(), "ssm_state": p.ssm_state.clone()})
                 for name, p in layers.items()}  # fmt: skip
    offsets = trees.node_offsets.to(torch.int32)
    # An attention layer's paged K/V cache on each side ([blocks, 2, block size, heads, dim]): the step's K/V moves
    # join the in-place commit graph; the reference moves them op by op.
    slots = torch.arange(plan.num_tokens, device=device) + 20
    caches = [torch.randn((plan.num_tokens // 16 + 4, 2, 16, 2, 4), generator=gen, device=device)]
    caches.append(caches[0].clone())

    def move(src, dst, cache=caches[0]):
        apply_kv_moves_indexed(cache, kv_move_index(slots[src], slots[dst], 16))

    mismatches = []
    for round_ in range(rounds):
        fresh = random_pending(gen, device, 2 * num_trees, plan.num_tree_tokens)
        for name in layers:  # the FULL graph's replay rewrites what the layers recorded, in place
            for field in ("x", "k", "deltas", "cum_log_decay"):
                getattr(layers[name], field).copy_(getattr(fresh, field))
        before = walks.replayed
        out = walks.walk(trees, targets(rng, plan, device), *args)
        replayed = walks.replayed > before
        walked = GdnCommitPlan(offsets, out["paths"], out["path_lengths"], out["commit_conv_index"])
        copies = GdnCommitPlan(
            offsets, *(t.clone() for t in (out["paths"], out["path_lengths"], out["commit_conv_index"]))
        )
        for pending in reference.values():
            commit_layer(pending, copies)
        move(out["kv_src"].clone(), out["kv_dst"].clone(), caches[1])
        kv_moves = (out["kv_src"], out["kv_dst"], move) if replayed else None
        commits.commit((num_trees * 65, num_trees), layers, walked, commit_layer, replayed, kv_moves)
        if not replayed:  # (the runner moves them itself then)
            move(out["kv_src"], out["kv_dst"])
        same = torch.equal(caches[0], caches[1]) and all(
            torch.equal(layers[n].conv_state, reference[n].conv_state)
            and torch.equal(layers[n].ssm_state, reference[n].ssm_state)
            for n in layers
        )
        if not same:
            mismatches.append(f"round {round_}")
    return dict(case="commit in place", trees=num_trees, replays=commits.replayed, mismatches=mismatches)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/walk_graphs_check"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    cases = [
        (1, 15, 8, 64, 3, False),  # the 27B drafter's depth, budget 64, batch 1, GDN conv
        (8, 15, 8, 64, 3, False),
        (8, 15, 8, 16, 3, False),  # a schedule's budget 16 at batch 8
        (32, 15, 8, 64, 0, False),  # attention-only target
        (5, 4, 3, 20, 3, True),  # cut trees
    ]
    results = []
    for case in cases:
        result = check_case(rng, device, *case)
        results.append(result)
        print(json.dumps(result), flush=True)
    for case in [(1, 15, 8, 64, 3), (8, 15, 8, 64, 3), (32, 7, 4, 31, 0)]:
        result = check_mixed_case(rng, device, *case)
        results.append(result)
        print(json.dumps(result), flush=True)
    for num_trees in (1, 8):
        result = check_placement(rng, device, num_trees)
        results.append(result)
        print(json.dumps(result), flush=True)
    for num_trees in (1, 8):
        result = check_commit_in_place(rng, device, num_trees)
        results.append(result)
        print(json.dumps(result), flush=True)
    ok = all(not r["mismatches"] and r["replays"] >= 3 for r in results)
    print("VERDICT:", "ALL-EQUAL" if ok else "MISMATCH", flush=True)
    with open(os.path.join(args.out, "walk_graphs_check.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), results=results, all_equal=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
