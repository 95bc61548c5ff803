"""Prefix caching beside tree steps, on vLLM's own KV-cache manager (CPU).

What ``DDTREE_PREFIX_CACHING`` rests on (docs/prefix-caching.md): a tree step writes the K/V of its root and nodes at
``c .. c + B`` and moves the accepted nodes' K/V to ``c + 1 .. c + m``; vLLM hashes (and so may hand to another
request) only blocks of tokens the request has finished. Modelled here with vLLM 0.25's ``KVCacheManager`` and
``Request`` (synchronous scheduling), ddtree's trees and acceptance (``step.plan_verify``, ``step.accept``) and the
runner's K/V move kernel on a paged CPU cache whose every slot holds the token whose K/V it is: no tree write lands
in a hashed block (beside the finished tokens' own K/V), every hashed block holds its tokens' K/V, and a second request whose prompt is the first one's
prompt and answer (a second turn) reads those tokens from the blocks it gets from the cache.
Not modelled: asynchronous scheduling (the scheduler's optimistic counts; vLLM caches there only up to
``num_computed_tokens - num_output_placeholders``), the drafter's own K/V, preemption.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ddtree.kernels.kv_moves import apply_kv_moves_indexed, kv_move_index  # noqa: E402
from ddtree.vllm.step import TreeStore, accept, plan_verify  # noqa: E402

BLOCK = 16
DEPTH, WIDTH, VOCAB = 5, 4, 50


class PagedModel:
    """vLLM's manager beside a paged cache ``[blocks, 2, BLOCK, 1, 1]`` whose slots hold token ids as their K/V."""

    def __init__(self, num_blocks: int = 96):
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
        )
        self.manager = KVCacheManager(
            config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.cache = torch.full((num_blocks, 2, BLOCK, 1, 1), -1.0)
        self.move_kv = apply_kv_moves_indexed  # the runner's K/V move (one gather and one scatter per layer)

    def request(self, name: str, prompt) -> Request:
        params = SamplingParams(max_tokens=10_000)
        return Request(name, list(prompt), params, None, block_hasher=self.hasher)

    def slots(self, req: Request, positions) -> torch.Tensor:
        blocks = self.manager.get_block_ids(req.request_id)[0]
        return torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions], dtype=torch.int64)

    def hashed_blocks(self, req: Request) -> set:
        pool = self.manager.block_pool.blocks
        return {b for b in self.manager.get_block_ids(req.request_id)[0] if pool[b].block_hash is not None}

    def write(self, req: Request, positions, tokens) -> None:
        """K/V of ``tokens`` at ``positions``. vLLM hashes a step's finished tokens when it allocates the step (the
        prompt's, the root's), before the forward writes them: a hashed block may be written only with the K/V of
        the tokens the request finished there, never with a tree node's."""
        slots = self.slots(req, positions)
        hashed, finished = self.hashed_blocks(req), req.all_token_ids
        for position, slot, token in zip(positions, slots.tolist(), tokens):
            if slot // BLOCK in hashed:
                assert position < req.num_tokens and finished[position] == token, "a tree write into a hashed block"
        values = torch.tensor([float(t) for t in tokens])
        self.cache[slots // BLOCK, 0, slots % BLOCK, 0, 0] = values
        self.cache[slots // BLOCK, 1, slots % BLOCK, 0, 0] = values

    def held(self, req: Request, positions) -> list:
        slots = self.slots(req, positions)
        return self.cache[slots // BLOCK, 0, slots % BLOCK, 0, 0].long().tolist()

    def check_hashed_blocks_hold_their_tokens(self, req: Request) -> int:
        """Every hashed block of ``req`` holds, slot by slot, the K/V of the request's tokens there."""
        blocks = self.manager.get_block_ids(req.request_id)[0]
        hashed = self.hashed_blocks(req)
        tokens = req.all_token_ids
        for i, block in enumerate(blocks):
            if block in hashed:
                positions = range(i * BLOCK, (i + 1) * BLOCK)
                assert self.held(req, positions) == [tokens[p] for p in positions], f"hashed block {i} is stale"
        return len(hashed)

    def prefill(self, req: Request) -> int:
        """Allocates the prompt (cache hits first) and writes what was not a hit; returns the hit tokens, whose K/V
        (read from the cache) must already be the prompt's."""
        hit_blocks, hits = self.manager.get_computed_blocks(req)[:2]  # (vLLM 0.33 returns a third count)
        prompt = req.prompt_token_ids
        new = len(prompt) - hits
        assert self.manager.allocate_slots(req, new, hits, hit_blocks) is not None
        assert self.held(req, range(hits)) == prompt[:hits], "a cache hit read K/V that is not the prompt's"
        self.write(req, range(hits, len(prompt)), prompt[hits:])
        req.num_computed_tokens = len(prompt)
        return hits

    def tree_step(self, req: Request, store: TreeStore, rng, budget: int) -> int:
        """One synchronous ddtree step of ``req``: proposal, verification of its whole tree (the root and ``budget``
        nodes written at ``c .. c + budget``), acceptance with a target that often agrees, the K/V moves, the output
        tokens. Returns the accepted drafts."""
        c = req.num_computed_tokens
        logits = rng.normal(size=(1, DEPTH, VOCAB)) * 2.0
        ids = np.argsort(-logits, axis=-1)[..., :WIDTH].astype(np.int32)
        log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
        lp = np.take_along_axis(log_probs, ids.astype(np.int64), axis=-1)
        drafts = store.propose([req.request_id], lp, ids, budget=budget)[0]
        self.manager.cache_blocks(req, c)  # what the scheduler's allocation does first: finished tokens only
        assert self.manager.allocate_slots(req, 1 + len(drafts), num_lookahead_tokens=DEPTH) is not None
        plan = plan_verify(
            store, [req.request_id], np.array([c]), np.array([1 + len(drafts)]), {req.request_id: drafts}
        )
        root = req.all_token_ids[c]
        self.write(req, range(c, c + 1 + len(drafts)), [root, *drafts])
        # The target's token at each node: mostly one of that node's children's (any child, so accepted nodes sit
        # out of place and move), so that paths of several nodes are accepted.
        parents, tokens = plan.trees.parents, plan.trees.tokens
        children = {}
        for node in range(1, len(parents)):
            children.setdefault(int(parents[node]), []).append(int(tokens[node - 1]))
        target = np.array(
            [
                rng.choice(children[n]) if n in children and rng.random() < 0.8 else VOCAB + 7
                for n in range(len(parents))
            ]
        )
        result = accept(plan, target.astype(np.int64), 1 + DEPTH + 1)
        src = self.slots(req, [c + int(s) for s in result.kv_src])
        dst = self.slots(req, [c + int(d) for d in result.kv_dst])
        assert not {int(s) // BLOCK for s in dst} & self.hashed_blocks(req), "a K/V move into a hashed block"
        if len(dst):
            self.move_kv(self.cache, kv_move_index(src, dst, BLOCK))
        row = result.output_tokens[0]
        out = [int(t) for t in row[row >= 0]]  # the accepted drafts, then the bonus token
        req.append_output_token_ids(out)
        req.num_computed_tokens = c + len(out)  # the root and the accepted drafts (vLLM drops the rejected)
        return len(out) - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hashed_blocks_hold_final_kv_and_a_second_turn_reads_the_tree_steps_tokens(seed):
    rng = np.random.default_rng(seed)
    model = PagedModel()
    store = TreeStore(budget=12)
    prompt = [int(t) for t in rng.integers(60, 90, size=37)]
    first = model.request("first", prompt)
    model.prefill(first)
    first.append_output_token_ids([int(rng.integers(60, 90))])  # the prefill's sampled token
    accepted = [model.tree_step(first, store, rng, budget=12) for _ in range(40)]
    model.manager.cache_blocks(first, first.num_computed_tokens)
    assert sum(accepted) > 20, "the model must accept paths of several nodes (moves) to test them"
    assert model.check_hashed_blocks_hold_their_tokens(first) >= 5

    # A second turn: the first request's prompt and answer, and new tokens; it shares every full block.
    turn = first.all_token_ids[: first.num_computed_tokens] + [3, 4, 5]
    second = model.request("second", turn)
    hits = model.prefill(second)  # its hit blocks must hold the first request's tokens, written by tree steps
    assert hits >= BLOCK * (first.num_computed_tokens // BLOCK) - BLOCK and hits > len(prompt)
    second.append_output_token_ids([int(rng.integers(60, 90))])
    for _ in range(20):
        model.tree_step(second, store, rng, budget=12)
    model.manager.cache_blocks(second, second.num_computed_tokens)
    model.check_hashed_blocks_hold_their_tokens(second)


def test_a_step_without_its_kv_moves_would_leave_a_hashed_block_stale():
    """The check can fail: skip the runner's K/V moves and a hashed block holds tree nodes' K/V, not its tokens'."""
    rng = np.random.default_rng(3)
    model = PagedModel()
    store = TreeStore(budget=12)
    req = model.request("r", [int(t) for t in rng.integers(60, 90, size=20)])
    model.prefill(req)
    req.append_output_token_ids([61])
    model.move_kv = lambda cache, index: None
    for _ in range(30):
        model.tree_step(req, store, rng, budget=12)
    model.manager.cache_blocks(req, req.num_computed_tokens)
    with pytest.raises(AssertionError, match="is stale"):
        model.check_hashed_blocks_hold_their_tokens(req)
