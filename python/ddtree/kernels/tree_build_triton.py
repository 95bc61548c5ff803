"""DDTree's tree build as one Triton kernel: one program per request runs the Rust core's best-first search.

The torch build (:mod:`ddtree.kernels.device_tree`) showed the trees can be built where the drafter's top-K lives,
exactly and capture-safe, but as ~500 small kernels: 1.3 ms of GPU time at budget 63 and batch 1 on an H200
(``gpu-h200-device-tree-33df4a8``), more than the host time it would save. Here the whole search is one launch.

The search is the core's (``rust/src/build.rs``), step for step. A prefix is a tuple of ranks; its score is the
float64 sum of its ranks' log-probabilities in depth order. Every emitted node keeps one candidate, its next child
not yet emitted (``head``: the rank after its last emitted child; the root's first is rank 0): exactly the set of
prefixes the core's heap holds, which pushes a popped prefix's next sibling and first child. Each of the
``budget`` pops takes the candidate of the highest score, equal scores by the lexicographically smaller rank tuple
(the heap's order), and emits it as the next node. So the nodes, their order and every tie are the core's, for
any log-probabilities the core accepts (also the slightly positive ones its tolerance lets through, which the torch
build clamps).

The program's state is a few register vectors of ``budget + 1`` entries (scores, depths, heads, candidate scores,
rank-tuple keys). Ties are broken on the keys: a node's rank tuple packed into 64-bit words, ``rank + 1`` per depth
in ``KEY_BITS`` bits, earlier depths in higher bits and a shorter tuple padded with zeros, so integer order word by
word is lexicographic order. Work per program: ``budget`` pops, each a serial chain of block reductions (the best
score; the tie count with the node; the node's score; its depth with its next child's rank; its key words), five
where there were eight before two pairs were packed into one 64-bit reduction each and the new node's key code was
computed from its parent's depth and rank (ptx: 30 barriers in the kernel at 64 nodes where there were 36, 24 at
128 where there were 30; not timed on a GPU); the keys are read only when the best score is tied.

The keys are held word-major, ``[KEY_WORDS, BLOCK_N]``. Node-major (``[BLOCK_N, KEY_WORDS]``), Triton 3.6 laid a
256-node block out with all 256 rows in every thread: ptxas spilled ~6.5 KB a thread, and budget 255 took 14 ms on an
H200 against 0.25 at 127 (``gpu-h200-device-tree-e9e09b0``). Word-major, ptxas reports no spill at 64, 128, 256 and
512 nodes (56-88 registers; ``test_the_kernel_keeps_its_state_in_registers`` compiles for sm_90a without a GPU);
not yet timed on a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from ddtree.kernels.device_tree import DeviceTrees, check_top_k

try:  # Triton is optional: the torch build runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None


def key_layout(depth: int, top_k: int):
    """``(bits per rank, ranks per 64-bit word, words)`` of the rank-tuple keys for ``depth`` ranks below
    ``top_k``: ``rank + 1`` needs ``top_k.bit_length()`` bits; a word holds 63 bits' worth (the sign bit unused)."""
    bits = max(1, int(top_k).bit_length())
    per_word = 63 // bits
    return bits, per_word, -(-depth // per_word)


if triton is not None:

    @triton.jit
    def _best_first_kernel(
        log_probs_ptr,
        token_ids_ptr,
        parents_ptr,
        depths_ptr,
        tokens_ptr,
        scores_ptr,
        ranks_ptr,
        budget,
        num_depths,
        top_k,
        lp_request_stride,
        lp_depth_stride,
        token_request_stride,
        token_depth_stride,
        out_stride,
        BLOCK_N: tl.constexpr,
        KEY_WORDS: tl.constexpr,
        KEY_BITS: tl.constexpr,
        RANKS_PER_WORD: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        log_probs = log_probs_ptr + request * lp_request_stride
        token_ids = token_ids_ptr + request * token_request_stride
        out = request * out_stride
        nodes = tl.arange(0, BLOCK_N)
        words = tl.arange(0, KEY_WORDS)
        no_score = float("-inf")
        # Per emitted node: its score, depth, next child's rank and rank-tuple key; its candidate's score (-inf: none).
        score = tl.zeros([BLOCK_N], dtype=tl.float64)
        depth = tl.zeros([BLOCK_N], dtype=tl.int32)
        head = tl.zeros([BLOCK_N], dtype=tl.int32)
        keys = tl.zeros([KEY_WORDS, BLOCK_N], dtype=tl.int64)  # word-major (see the module's note on layouts)
        # The root's 0.0 plus the first log-prob, as the core sums every score.
        root_child = tl.zeros([BLOCK_N], dtype=tl.float64) + tl.load(log_probs).to(tl.float64)
        candidate = tl.where(nodes == 0, root_child, no_score)
        tl.store(parents_ptr + out, -1)
        tl.store(depths_ptr + out, 0)
        tl.store(tokens_ptr + out, -1)
        tl.store(scores_ptr + out, 0.0)
        tl.store(ranks_ptr + out, -1)
        for n in range(1, budget + 1):
            best = tl.max(candidate, axis=0)
            tied = candidate == best
            # One reduction for the tie count (high half) and, without a tie, the node (low half: BLOCK_N - node;
            # at most 512 tied terms of < 2^10 each, so the halves never mix).
            tally = tl.sum(tl.where(tied, (1 << 32) + (BLOCK_N - nodes).to(tl.int64), 0), axis=0)
            parent = (BLOCK_N - (tally & 0xFFFFFFFF)).to(tl.int32)
            if (tally >> 32) > 1:
                # Equal scores: the smaller rank tuple. A candidate's is its parent's with ``head + 1`` at the
                # parent's depth.
                slot_word = depth // RANKS_PER_WORD
                slot_shift = ((RANKS_PER_WORD - 1 - depth % RANKS_PER_WORD) * KEY_BITS).to(tl.int64)
                next_code = (head + 1).to(tl.int64) << slot_shift
                for w in tl.static_range(KEY_WORDS):
                    word = tl.sum(tl.where(words[:, None] == w, keys, 0), axis=0)
                    word = word + tl.where(slot_word == w, next_code, 0)
                    smallest = tl.min(tl.where(tied, word, 0x7FFFFFFFFFFFFFFF), axis=0)
                    tied = tied & (word == smallest)
                parent = tl.min(tl.where(tied, nodes, BLOCK_N), axis=0)
            is_parent = nodes == parent
            parent_score = tl.sum(tl.where(is_parent, score, 0.0), axis=0)
            # The parent's depth (high half) and next child's rank (low half) in one reduction.
            packed = tl.sum(tl.where(is_parent, (depth.to(tl.int64) << 32) + head.to(tl.int64), 0), axis=0)
            parent_depth = (packed >> 32).to(tl.int32)
            rank = (packed & 0xFFFFFFFF).to(tl.int32)
            parent_keys = tl.sum(tl.where(is_parent[None, :], keys, 0), axis=1)
            code = (rank + 1).to(tl.int64) << ((RANKS_PER_WORD - 1 - parent_depth % RANKS_PER_WORD) * KEY_BITS).to(
                tl.int64
            )
            node_keys = parent_keys + tl.where(words == parent_depth // RANKS_PER_WORD, code, 0)
            node_depth = parent_depth + 1
            token = tl.load(token_ids + parent_depth * token_depth_stride + rank).to(tl.int64)
            tl.store(parents_ptr + out + n, parent.to(tl.int64))
            tl.store(depths_ptr + out + n, node_depth.to(tl.int64))
            tl.store(tokens_ptr + out + n, token)
            tl.store(scores_ptr + out + n, best)
            tl.store(ranks_ptr + out + n, rank.to(tl.int64))
            # The parent's next candidate: its next child (the popped one's next sibling), if its row has one.
            sibling = rank + 1
            has_sibling = sibling < top_k
            sibling_lp = tl.load(log_probs + parent_depth * lp_depth_stride + sibling, mask=has_sibling, other=0.0)
            sibling_score = tl.where(has_sibling, parent_score + sibling_lp.to(tl.float64), no_score)
            head = tl.where(is_parent, sibling, head)
            candidate = tl.where(is_parent, sibling_score, candidate)
            # The new node: its first child, if the drafter drafts that deep.
            has_child = node_depth < num_depths
            child_lp = tl.load(log_probs + node_depth * lp_depth_stride, mask=has_child, other=0.0)
            child_score = tl.where(has_child, best + child_lp.to(tl.float64), no_score)
            is_node = nodes == n
            score = tl.where(is_node, best, score)
            depth = tl.where(is_node, node_depth, depth)
            keys = tl.where(is_node[None, :], node_keys[:, None], keys)
            candidate = tl.where(is_node, child_score, candidate)


#: Warps per program. The search is a serial chain of block reductions: with one warp they are shuffles alone, with
#: more each also crosses warps through shared memory and a barrier (ptx at 128 nodes: 0 barriers with 1 warp, 24
#: with 2 or 4). On the H200 the build and layout as one CUDA graph took 0.047-0.048 ms with 1 warp against
#: 0.075-0.078 with 4 at budget 63 (batches 1-32), 0.100-0.109 against 0.164-0.176 at 127 and 0.33-0.36 against
#: 0.35-0.39 at 255, the trees the core's each time (``gpu-h200-device-plan-c4ff208``).
BUILD_NUM_WARPS = 1


def build_trees_triton(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    out: Optional[DeviceTrees] = None,
    num_warps: int = BUILD_NUM_WARPS,
) -> DeviceTrees:
    """:func:`ddtree.kernels.device_tree.build_trees` in one Triton launch, one program per request: the same
    arguments and checks, the same :class:`DeviceTrees` (the Rust core's trees, positive log-probabilities within
    the core's tolerance included). ``out``: the caller's tensors to write (``[R, budget + 1]`` each, contiguous;
    scores float64, the rest int64), returned: no allocation, so a CUDA graph can hold the launch. ``num_warps``:
    a program's warps (a power of two, 1 to 8)."""
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {num_warps}")
    if triton is None:
        raise RuntimeError("build_trees_triton needs triton; use ddtree.kernels.device_tree.build_trees")
    check_top_k(log_probs, token_ids, budget)
    num_reqs, depth, top_k = log_probs.shape
    bits, per_word, words = key_layout(depth, top_k)
    if bits * per_word > 63 or words < 1:
        raise ValueError(f"rank tuples of depth {depth} below {top_k} do not fit the kernel's keys")
    log_probs = log_probs if log_probs.stride(-1) == 1 else log_probs.contiguous()
    token_ids = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    size = budget + 1
    if out is None:
        device = log_probs.device
        out = DeviceTrees(
            *(torch.empty((num_reqs, size), dtype=torch.int64, device=device) for _ in range(3)),
            scores=torch.empty((num_reqs, size), dtype=torch.float64, device=device),
            ranks=torch.empty((num_reqs, size), dtype=torch.int64, device=device),
        )
    else:
        _check_out(out, num_reqs, size)
    parents, depths, tokens, scores, ranks = out.parents, out.depths, out.tokens, out.scores, out.ranks
    if num_reqs:
        _best_first_kernel[(num_reqs,)](
            log_probs,
            token_ids,
            parents,
            depths,
            tokens,
            scores,
            ranks,
            budget,
            depth,
            top_k,
            log_probs.stride(0),
            log_probs.stride(1),
            token_ids.stride(0),
            token_ids.stride(1),
            size,
            BLOCK_N=triton.next_power_of_2(size),
            KEY_WORDS=max(2, triton.next_power_of_2(words)),
            KEY_BITS=bits,
            RANKS_PER_WORD=per_word,
            num_warps=num_warps,
        )
    return out


def _check_out(out: DeviceTrees, num_reqs: int, size: int) -> None:
    for name in ("parents", "depths", "tokens", "scores", "ranks"):
        tensor = getattr(out, name)
        dtype = torch.float64 if name == "scores" else torch.int64
        if tensor.shape != (num_reqs, size) or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(
                f"build_trees_triton: out.{name} must be a contiguous [{num_reqs}, {size}] {dtype} tensor, got "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
