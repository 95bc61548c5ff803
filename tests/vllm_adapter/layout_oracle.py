"""The step layouts in numpy: the oracle of the Rust core's ``verify_layout_into`` / ``acceptance_layout_into``.

These are the adapter's former numpy implementations (checked end to end against sequential decoding on the GPU
before the layouts moved to Rust); tests compare the Rust layouts with them and use them to build kernel inputs.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

import ddtree


def conv_gather_index(windows: np.ndarray, node_offsets: np.ndarray) -> np.ndarray:
    """Rows of ``cat(histories, tree inputs)`` forming each node's conv window: ``[T, w + 1]`` int64.

    ``windows`` is ``compile_trees(..., window=w).windows``: per node its last ``w`` ancestors, oldest first,
    tree-local, ``-1 .. -w`` naming the newest .. oldest committed history entry. Request ``r``'s history is
    rows ``r*w .. r*w + w - 1`` (oldest first), node ``t`` of the flat batch is row ``R*w + t``; the last
    column is the node itself.
    """
    windows = np.asarray(windows, dtype=np.int64)
    node_offsets = np.asarray(node_offsets, dtype=np.int64)
    num_nodes, w = windows.shape
    num_requests = node_offsets.shape[0] - 1
    request = np.repeat(np.arange(num_requests, dtype=np.int64), np.diff(node_offsets))
    first = node_offsets[:-1][request][:, None]
    index = np.where(windows >= 0, num_requests * w + first + windows, request[:, None] * w + w + windows)
    own = num_requests * w + np.arange(num_nodes, dtype=np.int64)
    return np.concatenate([index, own[:, None]], axis=1)


def conv_commit_index(paths: np.ndarray, node_offsets: np.ndarray, w: int) -> np.ndarray:
    """Rows of ``cat(histories, tree inputs)`` forming each request's new conv history: ``[R, w]``, the last
    ``w`` entries of ``old history + accepted path`` (root included), oldest first; ``paths`` -1 padded."""
    paths = np.asarray(paths, dtype=np.int64)
    node_offsets = np.asarray(node_offsets, dtype=np.int64)
    num_requests = paths.shape[0]
    lengths = (paths >= 0).sum(axis=1)
    seq = lengths[:, None] + np.arange(w, dtype=np.int64)[None, :]  # the last w entries of the sequence
    from_path = seq >= w
    path_pos = np.clip(seq - w, 0, max(paths.shape[1] - 1, 0))
    nodes = np.take_along_axis(paths, path_pos, axis=1) if paths.shape[1] else np.zeros_like(seq)
    tree_row = num_requests * w + node_offsets[:-1][:, None] + nodes
    history_row = np.arange(num_requests, dtype=np.int64)[:, None] * w + seq
    return np.where(from_path, tree_row, history_row)


def commit_paths(paths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(paths padded with 0 as int32 [R, P], lengths int32 [R])`` for the GDN commit kernel."""
    paths = np.asarray(paths)
    valid = paths >= 0
    return np.where(valid, paths, 0).astype(np.int32), valid.sum(axis=1).astype(np.int32)


def verify_layout(trees, rows, starts, query_starts, logit_starts, num_rows: int, words: int, window: int):
    """What ``ddtree.verify_layout_into`` writes, from ``compile_trees`` and numpy."""
    offsets = trees.node_offsets
    sizes = np.diff(offsets)
    compiled = ddtree.compile_trees(trees, np.asarray(starts, dtype=np.int64), window=window or None)
    local = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], sizes)
    bits = np.zeros((int(offsets[-1]), words), dtype=np.int32)
    bits[:, : compiled.ancestor_bits.shape[1]] = compiled.ancestor_bits.view(np.int32)
    row_start = np.full(num_rows, -1, dtype=np.int32)
    row_start[np.asarray(rows)] = offsets[:-1]
    out = {
        "token_index": np.repeat(np.asarray(query_starts, dtype=np.int64), sizes) + local,
        "logit_rows": np.repeat(np.asarray(logit_starts, dtype=np.int64), sizes) + local,
        "positions": compiled.positions,
        "ancestor_bits": bits,
        "row_start": row_start,
        "node_offsets": offsets.astype(np.int32),
    }
    if window:
        out["conv_index"] = conv_gather_index(compiled.windows, offsets)
    return out


def drafter_context_order(token_index, trees, accepted, num_tokens: int) -> np.ndarray:
    """The step's rows with each tree's root and accepted path first (path order), its other nodes after."""
    order = np.arange(num_tokens, dtype=np.int64)
    offsets = trees.node_offsets.astype(np.int64)
    sizes = np.diff(offsets)
    tree = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)
    paths = np.asarray(accepted.paths, dtype=np.int64)
    on_path = paths >= 0
    key = on_path.sum(axis=1)[tree] + (np.arange(offsets[-1], dtype=np.int64) - offsets[tree])
    rows, places = np.nonzero(on_path)
    key[offsets[rows] + paths[rows, places]] = places
    nodes = np.lexsort((key, tree))
    order[token_index] = token_index[nodes]
    return order


def acceptance_layout(token_index, trees, accepted, num_tokens: int, width: int, window: int) -> Dict[str, np.ndarray]:
    """What ``ddtree.acceptance_layout_into`` writes, in numpy."""
    out = accepted.output_tokens
    rows = np.full((out.shape[0], width), -1, dtype=np.int32)
    cols = min(width, out.shape[1])
    rows[:, :cols] = out[:, :cols]
    padded, lengths = commit_paths(accepted.paths)
    layout = {
        "output_tokens": rows,
        "kv_src": token_index[accepted.kv_src],
        "kv_dst": token_index[accepted.kv_dst],
        "context_order": drafter_context_order(token_index, trees, accepted, num_tokens),
        "paths": padded,
        "path_lengths": lengths,
    }
    if window:
        layout["commit_conv_index"] = conv_commit_index(accepted.paths, trees.node_offsets, window)
    return layout
