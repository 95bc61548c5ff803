"""A step's verification layout from trees on the device: the Rust core's ``verify_layout_into`` as one Triton kernel,
for steps whose trees all have one size (a FULL-graph step of whole trees).

The runner's plan waits for the drafter's top-K on the host, builds the trees there and lays out what verification
reads (``rust/src/layout.rs``): each node's step index, logits row and position, its ancestor bits, its GDN conv
window, the device walk's node arrays and the drafts' step indices and tokens. With the trees built on the device
(:mod:`ddtree.kernels.tree_build_triton`), this kernel writes the same arrays there, so a step's trees need not reach
the host at all. One program per tree; per node, the ancestor bits and the conv window come from a walk up the
parent pointers (at most the drafter's depth steps), the rest is arithmetic on the node's index and depth.

The runner's device plan (``ddtree.vllm.device_plan``, ``DDTREE_DEVICE_PLAN``) calls :func:`whole_tree_layout_into`;
the oracle is the Rust layout (``tests/kernels/test_tree_layout_triton.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

try:  # Triton is optional
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None


@dataclass
class TreeLayout:
    """What ``verify_layout_into`` writes, ``T`` = trees x nodes per tree, ``R`` = trees."""

    token_index: torch.Tensor  # int64 [T]: each node's index among the step's tokens
    logit_rows: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]: the root's position plus the depth
    ancestor_bits: torch.Tensor  # int32 [T, words]: bit j of row i set when node j is i or an ancestor (tree-local)
    row_start: torch.Tensor  # int32 [num_rows]: each batch row's first node, -1 without a tree
    node_offsets: torch.Tensor  # int32 [R + 1]
    conv_index: Optional[torch.Tensor]  # int64 [T, window + 1] rows of cat(histories [R * window], tree inputs [T])
    depths: torch.Tensor  # int64 [T]
    root_index: torch.Tensor  # int64 [T]: the step index of the node's root
    node_parents: torch.Tensor  # int64 [T]: the parent as a node of the batch (a root: itself)
    node_tree: torch.Tensor  # int64 [T]
    node_local: torch.Tensor  # int64 [T]
    node_tokens: torch.Tensor  # int64 [T]: the draft token, a root's 0
    draft_step_index: torch.Tensor  # int64 [T - R]: each draft's index among the step's tokens
    draft_tokens: torch.Tensor  # int32 [T - R]


if triton is not None:

    @triton.jit
    def _tree_layout_kernel(
        parents_ptr,
        depths_ptr,
        tokens_ptr,
        starts_ptr,
        query_starts_ptr,
        logit_starts_ptr,
        token_index_ptr,
        logit_rows_ptr,
        positions_ptr,
        bits_ptr,
        conv_ptr,
        node_depths_ptr,
        root_index_ptr,
        node_parents_ptr,
        node_tree_ptr,
        node_local_ptr,
        node_tokens_ptr,
        draft_step_ptr,
        draft_tokens_ptr,
        num_trees,
        nodes_per_tree,
        words,
        max_depth,
        BLOCK_N: tl.constexpr,
        WORDS: tl.constexpr,
        WINDOW: tl.constexpr,
    ):
        tree = tl.program_id(0).to(tl.int64)
        local = tl.arange(0, BLOCK_N).to(tl.int64)
        valid = local < nodes_per_tree
        first = tree * nodes_per_tree
        nodes = first + local
        parent = tl.load(parents_ptr + nodes, mask=valid, other=-1).to(tl.int64)
        depth = tl.load(depths_ptr + nodes, mask=valid, other=0).to(tl.int64)
        token = tl.load(tokens_ptr + nodes, mask=valid, other=0).to(tl.int64)
        first_query = tl.load(query_starts_ptr + tree)
        tl.store(token_index_ptr + nodes, first_query + local, mask=valid)
        tl.store(logit_rows_ptr + nodes, tl.load(logit_starts_ptr + tree) + local, mask=valid)
        tl.store(positions_ptr + nodes, tl.load(starts_ptr + tree) + depth, mask=valid)
        tl.store(node_depths_ptr + nodes, depth, mask=valid)
        tl.store(root_index_ptr + nodes, first_query + local * 0, mask=valid)
        tl.store(node_parents_ptr + nodes, first + tl.where(parent >= 0, parent, local), mask=valid)
        tl.store(node_tree_ptr + nodes, tree + local * 0, mask=valid)
        tl.store(node_local_ptr + nodes, local, mask=valid)
        is_root = local == 0
        tl.store(node_tokens_ptr + nodes, tl.where(is_root, 0, token), mask=valid)
        # Tree r's drafts are the batch's draft slots first - r .. (every earlier tree has one root).
        draft = valid & (local > 0)
        drafts = first - tree + local - 1
        tl.store(draft_step_ptr + drafts, first_query + local, mask=draft)
        tl.store(draft_tokens_ptr + drafts, token.to(tl.int32), mask=draft)
        # Ancestor bits: the node and every ancestor, one walk up the parent pointers (parents come first).
        columns = tl.arange(0, WORDS)
        bits = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
        ancestor = tl.where(valid, local, -1)
        for _ in range(max_depth + 1):
            on = ancestor >= 0
            word = tl.where(on, ancestor // 32, -1)
            bit = (1 << (tl.where(on, ancestor, 0) % 32)).to(tl.int32)
            bits = bits | tl.where(columns[None, :] == word[:, None], bit[:, None], 0)
            ancestor = tl.load(parents_ptr + first + ancestor, mask=on, other=-1).to(tl.int64)
        rows = (nodes * words)[:, None] + columns[None, :]
        tl.store(bits_ptr + rows, bits, mask=valid[:, None] & (columns[None, :] < words))
        if WINDOW > 0:
            # Slot WINDOW - 1 - j: the (j + 1)-th ancestor, or past the root the request's history (-1 newest).
            history_rows = num_trees * WINDOW
            own_history = tree * WINDOW + WINDOW
            conv_row = nodes * (WINDOW + 1)
            ancestor = parent
            for j in tl.static_range(WINDOW):
                entry = tl.where(depth >= j + 1, ancestor, depth - j - 1)
                index = tl.where(entry >= 0, history_rows + first + entry, own_history + entry)
                tl.store(conv_ptr + conv_row + (WINDOW - 1 - j), index, mask=valid)
                ancestor = tl.load(parents_ptr + first + ancestor, mask=valid & (ancestor >= 0), other=-1).to(tl.int64)
            tl.store(conv_ptr + conv_row + WINDOW, history_rows + nodes, mask=valid)


def whole_tree_layout(
    parents: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    query_starts: torch.Tensor,
    logit_starts: torch.Tensor,
    num_rows: int,
    words: int,
    window: int,
    max_depth: int,
) -> TreeLayout:
    """The layout of ``R`` trees of ``N`` nodes each: ``parents`` (tree-local, -1 for the root), ``depths`` and
    ``tokens`` (a root's ignored) ``[R, N]`` in pop order, as :class:`ddtree.kernels.device_tree.DeviceTrees`
    holds them; tree ``r`` sits in batch row ``rows[r]``, its root at position ``starts[r]``, its nodes at step
    indices ``query_starts[r] ..`` and logits rows ``logit_starts[r] ..`` (all ``[R]`` int64). ``words`` per
    ancestor-bits row (at least ``ceil(N / 32)``), conv ``window`` (0: none), ``max_depth`` the deepest node's
    depth at most (the drafter's). The Rust core's ``verify_layout_into`` on the same trees writes the same."""
    if triton is None:
        raise RuntimeError("whole_tree_layout needs triton")
    if parents.dim() != 2 or depths.shape != parents.shape or tokens.shape != parents.shape:
        raise ValueError(
            f"parents, depths and tokens must all be [R, N]; got {list(parents.shape)}, {list(depths.shape)} and "
            f"{list(tokens.shape)}"
        )
    num_trees, size = parents.shape
    for name, placement in (("rows", rows), ("starts", starts), ("query_starts", query_starts)):
        if placement.shape != (num_trees,):
            raise ValueError(f"{name} must be [R] = [{num_trees}], got {list(placement.shape)}")
    if logit_starts.shape != (num_trees,):
        raise ValueError(f"logit_starts must be [R] = [{num_trees}], got {list(logit_starts.shape)}")
    if words * 32 < size:
        raise ValueError(f"rows of {words} words cannot hold a tree of {size} nodes (needs {-(-size // 32)})")
    if window < 0 or max_depth < 0:
        raise ValueError(f"window and max_depth must be >= 0, got {window} and {max_depth}")
    device = parents.device
    total = num_trees * size

    def new(shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)

    layout = TreeLayout(
        token_index=new(total),
        logit_rows=new(total),
        positions=new(total),
        ancestor_bits=new((total, words), torch.int32),
        row_start=torch.full((num_rows,), -1, dtype=torch.int32, device=device),
        node_offsets=torch.arange(0, total + 1, size, dtype=torch.int32, device=device),
        conv_index=new((total, window + 1)) if window else None,
        depths=new(total),
        root_index=new(total),
        node_parents=new(total),
        node_tree=new(total),
        node_local=new(total),
        node_tokens=new(total),
        draft_step_index=new(total - num_trees),
        draft_tokens=new(total - num_trees, torch.int32),
    )
    layout.row_start[rows] = layout.node_offsets[:-1]
    int64 = [t.to(torch.int64).contiguous() for t in (parents, depths, tokens, starts, query_starts, logit_starts)]
    out = {name: getattr(layout, name) for name in KERNEL_OUTPUTS if getattr(layout, name) is not None}
    whole_tree_layout_into(*int64, words=words, window=window, max_depth=max_depth, out=out)
    return layout


#: What :func:`whole_tree_layout_into` writes (``conv_index`` only with a conv window): every array of the layout
#: but the two that depend on the step's shape alone, ``row_start`` and ``node_offsets``.
KERNEL_OUTPUTS = (
    "token_index",
    "logit_rows",
    "positions",
    "ancestor_bits",
    "conv_index",
    "depths",
    "root_index",
    "node_parents",
    "node_tree",
    "node_local",
    "node_tokens",
    "draft_step_index",
    "draft_tokens",
)


def whole_tree_layout_into(
    parents: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
    starts: torch.Tensor,
    query_starts: torch.Tensor,
    logit_starts: torch.Tensor,
    words: int,
    window: int,
    max_depth: int,
    out,
) -> None:
    """:func:`whole_tree_layout`'s kernel alone, writing into the caller's tensors (``out``: ``KERNEL_OUTPUTS`` by
    name, with the shapes and dtypes of :class:`TreeLayout`'s fields; ``conv_index`` with a window only): one
    launch, no allocation, so a CUDA graph can hold it (the runner's device plan writes the plan's upload in place).
    The inputs are int64 and contiguous (``parents``, ``depths``, ``tokens`` ``[R, N]``; the rest ``[R]``);
    ``row_start`` and ``node_offsets``, which depend on the step's shape alone, are the caller's."""
    if triton is None:
        raise RuntimeError("whole_tree_layout_into needs triton")
    num_trees, size = parents.shape
    if not num_trees:
        return
    missing = [name for name in KERNEL_OUTPUTS if name not in out and (name != "conv_index" or window)]
    if missing:
        raise ValueError(f"whole_tree_layout_into: out lacks {missing}")
    _tree_layout_kernel[(num_trees,)](
        parents,
        depths,
        tokens,
        starts,
        query_starts,
        logit_starts,
        out["token_index"],
        out["logit_rows"],
        out["positions"],
        out["ancestor_bits"],
        out["conv_index"] if window else out["token_index"],  # not written without a window
        out["depths"],
        out["root_index"],
        out["node_parents"],
        out["node_tree"],
        out["node_local"],
        out["node_tokens"],
        out["draft_step_index"],
        out["draft_tokens"],
        num_trees,
        size,
        words,
        max_depth,
        BLOCK_N=triton.next_power_of_2(size),
        WORDS=triton.next_power_of_2(words),
        WINDOW=window,
    )
