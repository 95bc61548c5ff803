"""Would re-scoring a sibling's subtree restore a tree's gain? A measured prototype, offline, in one run.

    python benches/tree_rescoring.py [--pair tests/fixtures/models] [--drafter DIR] [--num-prompts 16]
        [--budgets 16 64] [--penalties 0 -0.25 -0.5 -1 -2] [--json FILE]

DFlash predicts every depth conditioned on its own most likely path, so once a tree's path takes a sibling (a
token that was not the drafter's top-1), the drafter's distributions for the depths below describe a context that
is no longer the one being verified (``benches/tree_gain.py`` measures it: 29-52% acceptance after a sibling
against 78-97% on the top-1 path for the committed pair). DDTree's builder scores a node by the product of its
tokens' probabilities, as if the depths were independent. The prototype adds ``penalty`` (a log-probability,
<= 0) for every depth below the first sibling on a node's path, so the budget moves from deep sibling subtrees to
the top-1 path and shallow siblings; ``penalty = 0`` is DDTree (checked against the Rust builder: same
acceptance at every step).

Method (exact for greedy decoding, as ``ddtree.training.dflash.teacher_forced_chain`` for the chain): the target's
fp32 greedy continuations of the held-out prompts (the pair's ``prompts.json``), the drafter's logits at every
bonus position in one teacher-forced pass, each builder's tree at each position, its accepted length (the longest
path that spells the continuation), and the engine's walk over the positions (each step starts after the last
one's accepted tokens and bonus). tau is pooled over the steps, as the engine reports it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def penalized_tree(log_probs: np.ndarray, budget: int, penalty: float) -> dict:
    """Best-first over rank tuples: the ``budget`` best prefixes under score = sum of log-probs + ``penalty``
    per depth below the path's first non-top-1 rank. Returns ``{(parent, rank): node}`` (the root is node 0).

    The penalty never raises a score along a path, and a node's next sibling scores no higher than the node, so
    popping a prefix and pushing its next sibling and first child yields the best prefixes in order."""
    depth, width = log_probs.shape
    children = {}
    if depth == 0 or budget == 0:
        return children
    # (-score, ranks) orders like the Rust builder: higher score first, ties by the smaller rank tuple.
    heap = [(-float(log_probs[0, 0]), (0,), 0, False)]  # entry: -score, ranks, parent node, branched above
    nodes = 1
    while heap and nodes <= budget:
        neg, ranks, parent, branched = heapq.heappop(heap)
        node, d, rank = nodes, len(ranks), ranks[-1]
        nodes += 1
        children[(parent, rank)] = node
        score = -neg
        if rank + 1 < width:  # next sibling: same parent, same depth
            sibling = score - float(log_probs[d - 1, rank]) + float(log_probs[d - 1, rank + 1])
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, branched))
        if d < depth:  # first child
            branched_child = branched or rank > 0
            child = score + float(log_probs[d, 0]) + (penalty if branched_child else 0.0)
            heapq.heappush(heap, (-child, ranks + (0,), node, branched_child))
    return children


def accepted_length(children: dict, token_ids: np.ndarray, truth: np.ndarray) -> int:
    """Greedy acceptance: the longest tree path spelling ``truth`` (the continuation's next tokens)."""
    node, accepted = 0, 0
    for d, token in enumerate(truth[: token_ids.shape[0]]):
        hits = np.flatnonzero(token_ids[d] == token)
        child = children.get((node, int(hits[0]))) if hits.size else None
        if child is None:
            break
        node, accepted = child, accepted + 1
    return accepted


def rust_tree_children(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> dict:
    """``ddtree.build_tree``'s tree in the same ``{(parent, rank): node}`` form."""
    import ddtree

    tree = ddtree.build_tree(log_probs, token_ids, budget)
    children = {}
    for node in range(1, len(tree)):
        d = int(tree.depths[node]) - 1
        rank = int(np.flatnonzero(token_ids[d] == tree.tokens[node - 1])[0])
        children[(int(tree.parents[node]), rank)] = node
    return children


def walk(accepted_at: list, first: int, last: int, depth: int) -> list:
    """The engine's steps over bonus positions ``first..last``: accepted + 1 per step."""
    lengths, anchor = [], first
    while anchor <= last:
        a = min(accepted_at[anchor - first], depth, last - anchor)
        lengths.append(a + 1)
        anchor += a + 1
    return lengths


@torch.no_grad()
def drafter_positions(pair: str, drafter_dir: str, num_prompts: int):
    """Per prompt: the drafter's log-probs ``[A, L, V]`` at every bonus position and the true next tokens."""
    from transformers import AutoModelForCausalLM

    from ddtree.engine import DFlashDraftModel
    from ddtree.engine.pair_demo import load_pair_prompts
    from ddtree.training.dflash import TargetFeatures, dflash_step_logits

    data = load_pair_prompts(pair)
    target = AutoModelForCausalLM.from_pretrained(os.path.join(pair, "target"), dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32, device="cpu")
    hook = TargetFeatures(target, drafter.target_layer_ids)
    bs = drafter.block_size
    out = []
    try:
        for prompt, continuation in zip(data["prompts"][:num_prompts], data["greedy_fp32"][:num_prompts]):
            tokens = torch.tensor([list(prompt) + list(continuation) + [drafter.mask_token_id] * bs])
            target(input_ids=tokens)
            features = hook.take()
            first, last = len(prompt), len(prompt) + len(continuation) - 2
            anchors = torch.arange(first, last + 1)[None]
            logits, labels = dflash_step_logits(drafter, target, tokens, features, anchors)
            out.append((logits[0].float().log_softmax(-1), labels[0].numpy(), first, last))
    finally:
        hook.remove()
    return out, bs - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default=os.path.join(ROOT, "tests", "fixtures", "models"))
    parser.add_argument("--drafter", help="the drafter's directory (default: PAIR/drafter; e.g. a snapshot)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--penalties", type=float, nargs="+", default=[0.0, -0.25, -0.5, -1.0, -2.0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "python"))
    torch.set_num_threads(1)
    started = time.perf_counter()
    prompts, depth = drafter_positions(args.pair, args.drafter or os.path.join(args.pair, "drafter"), args.num_prompts)
    print(f"drafter at {sum(p[0].shape[0] for p in prompts)} positions of {len(prompts)} prompts, depth {depth}: "
          f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    rows, width = [], max(args.budgets)
    tops = []
    for log_probs, labels, first, last in prompts:
        top = log_probs.topk(width, dim=-1)
        tops.append((top.values.numpy().astype(np.float32), top.indices.numpy().astype(np.int64), labels, first, last))
    chain = []
    for _, ids, labels, first, last in tops:
        hits = [int((row[:, 0] == truth).cumprod().sum()) for row, truth in zip(ids, labels)]
        chain.append(walk(hits, first, last, depth))
    chain_tau = float(np.mean([x for lengths in chain for x in lengths]))
    print(f"chain: tau {chain_tau:.3f} over {sum(map(len, chain))} steps", flush=True)
    for budget in args.budgets:
        rust, rust_at = [], []
        for values, ids, labels, first, last in tops:
            v, i = values[:, :, :budget], ids[:, :, :budget]
            at = [accepted_length(rust_tree_children(v[a], i[a], budget), i[a], labels[a]) for a in range(len(v))]
            rust.append(walk(at, first, last, depth))
            rust_at.append(at)
        rust_tau = float(np.mean([x for lengths in rust for x in lengths]))
        for penalty in args.penalties:
            steps = []
            for (values, ids, labels, first, last), baseline in zip(tops, rust_at):
                v, i = values[:, :, :budget], ids[:, :, :budget]
                at = [accepted_length(penalized_tree(v[a], budget, penalty), i[a], labels[a]) for a in range(len(v))]
                if penalty == 0.0 and at != baseline:  # the prototype without a penalty is DDTree's builder
                    raise AssertionError(f"budget {budget}: the Python builder differs from the Rust builder")
                steps.append(walk(at, first, last, depth))
            tau = float(np.mean([x for lengths in steps for x in lengths]))
            row = {
                "budget": budget,
                "penalty": penalty,
                "tau": round(tau, 4),
                "steps": sum(map(len, steps)),
                "x_chain": round(tau / chain_tau, 4),
                "x_ddtree": round(tau / rust_tau, 4),
            }
            rows.append(row)
            print(
                f"budget {budget:4d} penalty {penalty:+.2f}: tau {tau:.3f} over {row['steps']} steps, "
                f"{row['x_chain']:.3f}x chain, {row['x_ddtree']:.3f}x DDTree (Rust builder: tau {rust_tau:.3f})",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chain_tau": chain_tau, "rows": rows, "prompts": len(prompts), "depth": depth}, f, indent=1)


if __name__ == "__main__":
    main()
