"""Host cost of structured outputs with trees (``DDTREE_STRUCTURED_OUTPUTS``): a step's grammar rows through patch
12a (one row per tree node, ``grammar.fill_step_bitmask``) against vLLM's own rows for its chain, in one run.

    python benches/bench_grammar_masks.py [--vocab 151936] [--budget 63] [--depth 15] [--chain 15]
                                          [--batches 1 8 32] [--repeat 7] [--json FILE]

Both sides run vLLM's ``Scheduler.get_grammar_bitmask`` (this repository's wrapper for the trees, vLLM's code for the
chain) on one xgrammar JSON-schema grammar over a synthetic BPE-like vocabulary of ``--vocab`` tokens, every request
at the same committed text, in three places of the JSON text: inside a key, inside a free string value (the dear
case: nearly every token is allowed and xgrammar checks each) and inside a number. The trees are the worst case for
the masks: every node's token is one the grammar allows after its path (a drafter that never leaves the grammar), so
every node gets a row of its own; ``--budget`` nodes, at most ``--depth`` deep, a chain of branches. The chain is
``--chain`` allowed tokens. Times are the median of ``--repeat`` steps, each step every request's rows; the trees'
also with the walks on the calling thread only (``tree_one_thread_ms``: without the walk pool).

CPU only (no GPU is involved in either side's rows); it needs vLLM and xgrammar (the test install).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import string
import sys
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import torch

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "count"],
}
#: The committed text of each place in the JSON text.
PLACES = {"key": '{"na', "string": '{"name": "the quick ', "number": '{"name": "x", "count": 12'}


def synthetic_vocab(size: int, seed: int = 0) -> List[str]:
    """Every printable ASCII character, then random pieces of 2-8 characters drawn like text (letters and spaces
    mostly, digits and JSON punctuation now and then), then the stop token last."""
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase * 6 + string.ascii_uppercase + " " * 12 + string.digits * 2 + '{}[]":,.-_\\'
    vocab = list(dict.fromkeys(string.printable))
    seen = set(vocab)
    while len(vocab) < size - 1:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab + ["<eos>"]


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    import xgrammar as xgr

    row = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(row, 0)
    words = row[0].numpy().astype(np.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])


def valid_tree(matcher, vocab_size: int, budget: int, depth: int, rng: np.random.Generator):
    """A tree of ``budget`` draft nodes whose every token the grammar allows after its parent's path: parents in
    pop order (``[-1, ...]``) and the nodes' tokens."""
    parents, tokens, depths, forks = [-1], [], [0], [matcher.fork()]
    choices = {0: list(rng.permutation(allowed_tokens(forks[0], vocab_size)))}
    while len(tokens) < budget:
        last = len(parents) - 1
        open_nodes = [j for j in range(len(parents)) if depths[j] < depth and choices.get(j)]
        if not open_nodes:
            break
        parent = last if last in open_nodes and rng.random() < 0.6 else int(rng.choice(open_nodes))
        token = int(choices[parent].pop())
        fork = forks[parent].fork()
        if not fork.accept_token(token):
            continue
        parents.append(parent)
        tokens.append(token)
        depths.append(depths[parent] + 1)
        forks.append(fork)
        if not fork.is_terminated():
            choices[len(parents) - 1] = list(rng.permutation(allowed_tokens(fork, vocab_size)))[:64]
    return np.array(parents, dtype=np.int64), np.array(tokens, dtype=np.int64)


def scheduler_for(requests: Dict, budget: int, ddtree: bool, vocab_size: int):
    """vLLM's Scheduler and StructuredOutputManager with the attributes their grammar code reads (a ddtree engine's
    or a chain's)."""
    import xgrammar as xgr
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = SimpleNamespace(
        additional_config={"ddtree": {"budget": budget}} if ddtree else {},
        num_speculative_tokens=budget,
        scheduler_config=SimpleNamespace(max_num_seqs=max(32, len(requests))),
        model_config=SimpleNamespace(is_diffusion=False),
    )
    manager = object.__new__(StructuredOutputManager)
    manager.__dict__.update(
        vllm_config=config,
        backend=SimpleNamespace(allocate_token_bitmask=lambda rows: xgr.allocate_token_bitmask(rows, vocab_size)),
        reasoner_cls=None,
        enable_in_reasoning=False,
        _grammar_bitmask=None,
        _full_mask=torch.tensor(-1, dtype=torch.int32),
        fill_bitmask_parallel_threshold=128,
    )
    scheduler = object.__new__(Scheduler)
    scheduler.__dict__.update(vllm_config=config, requests=requests, structured_output_manager=manager)
    return scheduler


def median_ms(call, repeat: int) -> float:
    call()  # (buffers allocated, code warm)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(compiled, vocab_size: int, place: str, batch: int, args, rng) -> Dict:
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from ddtree.vllm import grammar

    def request():
        matcher = xgr.GrammarMatcher(compiled)
        if not matcher.accept_string(PLACES[place]):
            raise SystemExit(f"the grammar refuses the committed text {PLACES[place]!r}")
        state = SimpleNamespace(grammar=XgrammarGrammar(vocab_size, matcher, compiled), reasoning_ended=None)
        return SimpleNamespace(use_structured_output=True, structured_output_request=state, is_prefill_chunk=False)

    requests = {f"r{i}": request() for i in range(batch)}
    trees = {
        req_id: valid_tree(r.structured_output_request.grammar.matcher, vocab_size, args.budget, args.depth, rng)
        for req_id, r in requests.items()
    }
    nodes = sum(len(parents) for parents, _ in trees.values())
    ids = list(requests)
    tree_step = SimpleNamespace(
        num_scheduled_tokens={i: len(trees[i][0]) for i in ids},
        scheduled_spec_decode_tokens={i: [-1] * (len(trees[i][0]) - 1) for i in ids},
        has_structured_output_requests=True,
    )
    grammar.publish_step(grammar.StepTrees(tree_step, ids, lambda: _batch(trees, ids)))
    ours = scheduler_for(requests, args.budget, True, vocab_size)
    tree_ms = median_ms(lambda: ours.get_grammar_bitmask(tree_step), args.repeat)
    with one_thread(grammar):
        tree_serial_ms = median_ms(lambda: ours.get_grammar_bitmask(tree_step), args.repeat)
    # The chain: each request's deepest path extended to --chain allowed tokens (vLLM accepts each to fill the next).
    chains = {i: valid_tree(requests[i].structured_output_request.grammar.matcher, vocab_size, args.chain, args.chain,
                            _chain_rng(rng))[1] for i in ids}  # fmt: skip
    chain_step = SimpleNamespace(
        num_scheduled_tokens={i: 1 + len(chains[i]) for i in ids},
        scheduled_spec_decode_tokens={i: [int(t) for t in chains[i]] for i in ids},
        has_structured_output_requests=True,
    )
    theirs = scheduler_for(requests, args.chain, False, vocab_size)
    chain_ms = median_ms(lambda: theirs.get_grammar_bitmask(chain_step), args.repeat)
    chain_rows = sum(1 + len(c) for c in chains.values())
    grammar.publish_step(None)
    return {
        "place": place,
        "batch": batch,
        "tree_rows": nodes,
        "tree_ms": round(tree_ms, 3),
        "tree_us_per_row": round(tree_ms * 1e3 / nodes, 2),
        "tree_one_thread_ms": round(tree_serial_ms, 3),
        "chain_rows": chain_rows,
        "chain_ms": round(chain_ms, 3),
        "chain_us_per_row": round(chain_ms * 1e3 / chain_rows, 2),
        "tree_over_chain": round(tree_ms / chain_ms, 2) if chain_ms else None,
    }


@contextlib.contextmanager
def one_thread(grammar_module):
    """The trees walked one after the other on the calling thread (the walk pool replaced by an inline one)."""

    class Inline:
        def submit(self, work):
            done = Future()
            done.set_result(work())
            return done

    saved = grammar_module._walk_pool
    grammar_module._walk_pool = Inline
    try:
        yield
    finally:
        grammar_module._walk_pool = saved


def _chain_rng(rng: np.random.Generator):
    """A generator whose draws always extend the last node: a chain."""

    class Chain:
        def random(self):
            return 0.0

        def permutation(self, values):
            return rng.permutation(values)

        def choice(self, values):
            return values[-1]

    return Chain()


class _Batch(SimpleNamespace):
    """The trees in ``TreeBatch``'s CSR layout (what ``StepTrees.by_request`` reads)."""

    def __len__(self):
        return len(self.node_offsets) - 1


def _batch(trees: Dict, ids: List[str]) -> _Batch:
    parents = [trees[i][0] for i in ids]
    tokens = [trees[i][1] for i in ids]
    return _Batch(
        parents=np.concatenate(parents),
        tokens=np.concatenate(tokens),
        node_offsets=np.cumsum([0] + [len(p) for p in parents]),
        token_offsets=np.cumsum([0] + [len(t) for t in tokens]),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--budget", type=int, default=63)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--chain", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--places", nargs="+", default=list(PLACES), choices=list(PLACES))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()

    import xgrammar as xgr

    from ddtree.vllm import patches

    patches.apply()
    started = time.perf_counter()
    vocab = synthetic_vocab(args.vocab)
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    print(f"vocabulary {len(vocab)}, grammar compiled in {time.perf_counter() - started:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    print(
        "place  batch  tree rows  tree ms  us/row  one thread ms  chain rows  chain ms  us/row  tree/chain", flush=True
    )
    for place in args.places:
        for batch in args.batches:
            row = measure(compiled, len(vocab), place, batch, args, rng)
            rows.append(row)
            print(
                f"{place:6} {batch:5} {row['tree_rows']:10} {row['tree_ms']:8.3f} {row['tree_us_per_row']:7.2f} "
                f"{row['tree_one_thread_ms']:14.3f} {row['chain_rows']:11} {row['chain_ms']:9.3f} {row['chain_us_per_row']:7.2f} "
                f"{row['tree_over_chain']:10}",
                flush=True,
            )
            if args.json:  # written as each row lands
                with open(args.json, "w") as handle:
                    json.dump({"args": vars(args), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
