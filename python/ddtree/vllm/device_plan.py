"""A steady step's plan built on the device (``DDTREE_DEVICE_PLAN``: ``auto``, the default, where the engine allows it).

The usual step under asynchronous scheduling verifies the last proposal's trees, whole, for every request in the
proposal's order. Its host plan waits for the drafter's top-K to reach the host, builds the trees in the Rust core,
lays them out into the pinned staging buffer, uploads it and replays the placement graph: on the H200 host 0.23 ms
of a batch-1 step and 0.58 ms at batch 32 (``gpu-h200-pair-c0abd2f``), the largest part of ddtree's host work, and
the GPU idles from the drafter's end until the upload. Here the same step's trees are built and laid out by two
Triton kernels (``ddtree.kernels.tree_build_triton``, ``tree_layout_triton``: the Rust core's trees and layout,
exactly) from a device copy of the drafter's top-K, inside one CUDA graph per step shape with the placement:

* the host uploads the plan staging's arrays as before, but what depends on the step's shape alone (the rows, node
  offsets, step indices, the walk's tree and local indices: written again only when another upload went through the
  staging since a device-planned step's, ``constants_stale``) and the
  step's serial; the arrays that depend on the trees are left as they are, and the layout kernel writes them over
  on the device, after the copy (stream order). A step right after another device-planned step of its shape
  uploads nothing at all (``resumes``): the device buffer still holds the constants, and the graph writes the serial
  from a device counter it advances;
* the graph reads the top-K from one persistent device buffer (the drafter packs it there, ``pack_target``; with
  ``DDTREE_TOPK_GRAPHS`` it is copied there, ``keep_top_k``) and the trees' scratch at fixed addresses, so one
  replay per step is all the host launches;
* the host's plan object is the shape's (counts, rows, budgets: constants) with the step's serial; its trees are
  built on the host only when the statistics read them, from the same top-K once it has landed
  (``ddtree.vllm.step.DeferredTrees``).

With ``DDTREE_DEVICE_PLAN_SUBSETS`` (on by default; ``0`` turns it off) a step of some of the kept proposal's requests, in any
order (after a request ends, vLLM moves another into its slot), is planned here too: its rows of the kept top-K are
gathered by an uploaded row index before the build (:meth:`DevicePlanner.rows_in_kept`), in a layout and graph of
their own; such a step uploads every time and no step resumes from it.

The host neither waits for the top-K nor builds trees on such a step. What it still reads of the trees: the
drafter's fit test below ``max_model_len`` takes the drafter's depth as every tree's deepest node, so only steps
far from that limit are planned here (:func:`fits_far_from_the_end`); everything else (mixed steps, cut trees, filler
trees, a schedule's trees above :data:`MAX_TREE_SIZE` nodes) keeps the host plan.

Torch only (no vLLM import): CI runs the planner's kernels under Triton's CPU interpreter against the host plan.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from ddtree.kernels.device_tree import DeviceTrees

#: Largest tree (budget + 1 nodes) planned on the device. The build and layout graph (one warp a program) took
#: 0.047 ms at budget 63, 0.10-0.11 at 127 and 0.33-0.36 at 255 on an H200 (``gpu-h200-device-plan-c4ff208``; 255's
#: 14 ms cliff of ``gpu-h200-device-tree-e9e09b0`` is gone with the word-major keys), against the host's build and
#: layout of 0.09 ms at budget 255 and batch 1 and 1.65 ms at batch 32: at 255 the device plan would add GPU time
#: to a host-bound batch-1 step and save host time at 32. Kept at 128 until a GPU run of budget 255 says which.
MAX_TREE_SIZE = 128


class DevicePlanner:
    """The device side of device-planned steps: the drafter's top-K kept at a fixed address, the trees' scratch and
    the placement constants by step shape, and the launches of one step (:meth:`build_and_lay_out`)."""

    def __init__(self, device, max_requests: int, draft_len: int, top_k: int, conv_window: int, words: int):
        self.device = torch.device(device)
        self.max_requests, self.draft_len, self.top_k = max_requests, draft_len, top_k
        self.conv_window, self.words = conv_window, words
        # [rows, 2K] float32: the log-probabilities, then the ids' int32 bits (the proposer's packed layout).
        self.top_k_buffer = torch.zeros((max_requests * draft_len, 2 * top_k), dtype=torch.float32, device=self.device)
        self._kept_for: Optional[tuple] = None  # the request ids of the proposal whose top-K the buffer holds
        # By step shape, (requests, tree size): the trees' scratch and the placement's starts and query starts.
        self._shapes: Dict[Tuple[int, int], Tuple[DeviceTrees, torch.Tensor, torch.Tensor]] = {}
        # The staging's state right after the last device-planned upload, which carried its shape's constants
        # (``(layout key, layouts made, uploads)``): any other upload or layout since makes them stale.
        self._constants_uploaded: Optional[tuple] = None
        # By step shape, (requests, tree size): the runner's plan of that shape and its staged arrays.
        self.templates: Dict[Tuple[int, int], tuple] = {}
        # The next step's serial on the device: the graph writes it into the upload's view and adds one, so a
        # device-planned step right after another of its shape uploads nothing (``resumes``).
        self.serial = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        # After a device-planned step: (its shape, the staging's layout key and uploads, the next serial).
        self._resume: Optional[tuple] = None
        # The kept proposal's row of each of its requests (made on the first subset step of that proposal).
        self._rows_of: Optional[Tuple[tuple, Dict[str, int]]] = None
        # A subset step's top-K rows, gathered from the kept buffer (its leading rows; made at the first such step).
        self._gathered: Optional[torch.Tensor] = None

    def pack_target(self, rows: int) -> Optional[torch.Tensor]:
        """Where the proposer packs a drafter pass's ``rows`` top-K rows (the buffer's leading rows: no copy at
        :meth:`keep_top_k`), None if they do not fit."""
        return self.top_k_buffer[:rows] if rows <= self.top_k_buffer.shape[0] else None

    def keep_top_k(self, packed: torch.Tensor, req_ids: tuple) -> None:
        """After a drafter pass: its packed top-K ``[R * L, 2K]`` (float32) in the fixed buffer (copied there
        unless it was packed there, :meth:`pack_target`), for the proposal of ``req_ids`` (the tuple the store's
        proposal holds: recognised by identity)."""
        rows = packed.shape[0]
        if rows > self.top_k_buffer.shape[0] or packed.shape[1] != self.top_k_buffer.shape[1]:
            raise ValueError(
                f"DDTree: a top-K of {list(packed.shape)} does not fit the device plan's {list(self.top_k_buffer.shape)}"
            )
        if packed.data_ptr() != self.top_k_buffer.data_ptr():
            self.top_k_buffer[:rows].copy_(packed)
        self._kept_for = req_ids

    def holds(self, req_ids: tuple) -> bool:
        """Whether the buffer holds the top-K of the proposal of ``req_ids`` (that very tuple)."""
        return self._kept_for is req_ids

    @property
    def kept_for(self) -> Optional[tuple]:
        """The request ids of the proposal whose top-K the buffer holds (None: none)."""
        return self._kept_for

    def rows_in_kept(self, req_ids) -> Optional[np.ndarray]:
        """``[R]`` int64: the row of each of ``req_ids`` in the kept proposal (a subset step: requests finished or
        reordered since it); None if one of them is not in it."""
        kept = self._kept_for
        if kept is None:
            return None
        if self._rows_of is None or self._rows_of[0] is not kept:
            self._rows_of = (kept, {req_id: row for row, req_id in enumerate(kept)})
        rows = self._rows_of[1]
        if not all(req_id in rows for req_id in req_ids):
            return None
        return np.fromiter((rows[req_id] for req_id in req_ids), dtype=np.int64, count=len(req_ids))

    def forget(self) -> None:
        """The buffer's top-K is no longer any pending proposal's (e.g. a drafter pass that did not keep its own)."""
        self._kept_for = None

    def serves(self, num_requests: int, tree_size: int) -> bool:
        """Whether a step of ``num_requests`` whole trees of ``tree_size`` nodes can be planned here."""
        return 2 <= tree_size <= MAX_TREE_SIZE and 0 < num_requests <= self.max_requests

    def constants_stale(self, staging) -> bool:
        """Whether the staging's host buffer may hold other bytes where this step's shape constants go: a layout
        made since a device-planned step's upload carried them, or any other upload through the staging since (a
        host-planned step whose trees fill the same layout, the same trees and tokens in other sizes, writes its own
        offsets there). The caller then writes them, and calls :meth:`uploaded_constants` after its upload."""
        return self._constants_uploaded != (staging.layout_key(), staging.layouts, staging.uploads)

    def uploaded_constants(self, staging) -> None:
        """Right after a device-planned step's upload, which carried its shape's constants."""
        self._constants_uploaded = (staging.layout_key(), staging.layouts, staging.uploads)

    def resumes(self, num_requests: int, tree_size: int, staging, serial: int) -> bool:
        """Whether this step can run on what the last device-planned step left: the same shape, nothing uploaded
        through ``staging`` since (so the device buffer holds this layout's constants) and ``serial`` the one the
        device holds next (no step planned on the host since)."""
        return self._resume == (num_requests, tree_size, staging.layout_key(), staging.uploads, serial)

    def planned(self, num_requests: int, tree_size: int, staging, serial: int) -> None:
        """A device-planned step of ``serial`` ran (its graph replayed: the device's serial is ``serial + 1``)."""
        self._resume = (num_requests, tree_size, staging.layout_key(), staging.uploads, serial + 1)

    def not_resumable(self) -> None:
        """After a device-planned step whose upload the next step cannot run on (a subset step's row index)."""
        self._resume = None

    def build_and_lay_out(self, out: Mapping[str, torch.Tensor], num_requests: int, tree_size: int) -> None:
        """The step's trees from the kept top-K, laid out into ``out`` (the plan upload's device views, every
        ``tree_layout_triton.KERNEL_OUTPUTS`` array), and the step's serial from the device's into ``out``'s
        ``step_serial``: a few launches, no allocation, no host synchronisation."""
        from ddtree.kernels.tree_build_triton import build_trees_triton
        from ddtree.kernels.tree_layout_triton import whole_tree_layout_into

        if "step_serial" in out:
            out["step_serial"].copy_(self.serial)
            self.serial.add_(1)

        depth, k = self.draft_len, self.top_k
        if "proposal_rows" in out:  # a subset step: its requests' rows of the kept proposal, in the step's order
            if self._gathered is None:
                self._gathered = torch.empty_like(self.top_k_buffer).view(self.max_requests, depth, 2 * k)
            packed = self._gathered[:num_requests]
            kept = self.top_k_buffer.view(self.max_requests, depth, 2 * k)
            torch.index_select(kept, 0, out["proposal_rows"], out=packed)
        else:
            packed = self.top_k_buffer[: num_requests * depth].view(num_requests, depth, 2 * k)
        log_probs, token_ids = packed[..., :k], packed[..., k:].view(torch.int32)
        scratch, starts, query_starts = self._shape(num_requests, tree_size)
        trees = build_trees_triton(log_probs, token_ids, tree_size - 1, out=scratch)
        # (Positions from zero: under asynchronous scheduling the placement takes each root's position from vLLM's
        # corrected ones on the device, plus the depths, and never reads these.)
        whole_tree_layout_into(
            trees.parents,
            trees.depths,
            trees.tokens,
            starts,
            query_starts,
            query_starts,  # every token of a whole-tree step has its logits row, in order
            words=self.words,
            window=self.conv_window,
            max_depth=depth,
            out=out,
        )

    def _shape(self, num_requests: int, tree_size: int) -> Tuple[DeviceTrees, torch.Tensor, torch.Tensor]:
        """A step shape's device state, made at its first step: the trees' scratch, the roots' (unread) starts and
        the trees' query starts."""
        key = (num_requests, tree_size)
        state = self._shapes.get(key)
        if state is None:

            def new(dtype=torch.int64):
                return torch.empty((num_requests, tree_size), dtype=dtype, device=self.device)

            scratch = DeviceTrees(new(), new(), new(), new(torch.float64), new())
            starts = torch.zeros(num_requests, dtype=torch.int64, device=self.device)
            query_starts = torch.arange(num_requests, dtype=torch.int64, device=self.device) * tree_size
            state = self._shapes[key] = (scratch, starts, query_starts)
        return state


def fits_far_from_the_end(num_computed_tokens: np.ndarray, tree_size: int, draft_len: int, max_model_len: int) -> bool:
    """Whether every request stays far enough below ``max_model_len`` that a device-planned step changes no
    decision the host makes from its trees' depths: the drafter's fit test after the step (the host plan takes each
    tree's deepest node, the device plan the drafter's depth, an upper bound) and the next step's room. The margin
    covers a whole tree twice (the host's counts run up to a tree ahead of the GPU's under asynchronous scheduling)
    and the drafter's queries."""
    if num_computed_tokens.shape[0] == 0:
        return False
    margin = 2 * tree_size + 2 * (draft_len + 1)
    # (A list's max: numpy's reduction costs ~5 us on a cold CPU path here, the list ~1.)
    return max(num_computed_tokens.tolist()) + margin <= max_model_len
