"""Draft-tree topology helpers shared by the tree verification references.

A draft tree of ``N`` nodes is flattened into a ``parents`` tensor ``[N]``:
node 0 is the root (``parents[0] == -1``) and every other node ``i`` has
``0 <= parents[i] < i``. Keeping nodes topologically ordered (parents before
children) is what makes every "ancestor" relation point to a smaller index, so
masks built from it are lower triangular and the tree delta rule can be solved
by forward substitution.

Several requests' trees are batched the way vLLM flattens tokens: the nodes of
request ``r`` occupy rows ``node_offsets[r]:node_offsets[r + 1]`` and their
``parents`` are *local* to the request (the root of every request has -1).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

IndexLike = Union[torch.Tensor, Sequence[int]]


def as_index_tensor(values: IndexLike, name: str, device=None) -> torch.Tensor:
    """Return ``values`` as a 1-D int64 tensor, or raise ValueError naming ``name``."""
    tensor = torch.as_tensor(values, device=device)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"{name} must be an integer tensor of shape [N], got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must have shape [N] (1-D), got shape {list(tensor.shape)}")
    return tensor.to(torch.int64)


def validate_parents(parents: IndexLike, name: str = "parents", device=None) -> torch.Tensor:
    """Check one tree's parent array and return it as int64 ``[N]``.

    Raises ValueError unless ``parents[0] == -1`` and ``0 <= parents[i] < i``
    for ``i >= 1`` (root first, nodes topologically ordered).
    """
    parents = as_index_tensor(parents, name, device)
    if parents.numel() == 0:
        raise ValueError(f"{name} must have shape [N] with N >= 1 (the root), got an empty tensor")
    if int(parents[0]) != -1:
        raise ValueError(f"{name}[0] must be -1 (node 0 is the root), got {int(parents[0])}")
    node_index = torch.arange(parents.numel(), device=parents.device)
    bad = (parents[1:] < 0) | (parents[1:] >= node_index[1:])
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0]) + 1
        raise ValueError(
            f"{name}[i] must satisfy 0 <= {name}[i] < i (nodes topologically ordered, root first); "
            f"got {name}[{first}] = {int(parents[first])}"
        )
    return parents


def validate_node_offsets(node_offsets: IndexLike, total_nodes: int, device=None) -> torch.Tensor:
    """Check CSR offsets ``[R + 1]``: start at 0, end at ``total_nodes``, every tree non-empty."""
    offsets = as_index_tensor(node_offsets, "node_offsets", device)
    if offsets.numel() < 2:
        raise ValueError(f"node_offsets must have shape [R + 1] with R >= 1, got shape {list(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total_nodes:
        raise ValueError(
            f"node_offsets must start at 0 and end at the number of nodes ({total_nodes}), got {offsets.tolist()}"
        )
    if bool((offsets[1:] <= offsets[:-1]).any()):
        raise ValueError(f"node_offsets must be strictly increasing (every request has a root), got {offsets.tolist()}")
    return offsets


def validate_batched_parents(parents: IndexLike, node_offsets: torch.Tensor, device=None) -> torch.Tensor:
    """Check request-local parents ``[T]`` for every request slice of ``node_offsets``."""
    parents = as_index_tensor(parents, "parents", device)
    for request, (start, end) in enumerate(zip(node_offsets[:-1].tolist(), node_offsets[1:].tolist())):
        validate_parents(parents[start:end], name=f"parents (request {request}, local)")
    return parents


def ancestor_or_self_mask(parents: torch.Tensor) -> torch.Tensor:
    """Boolean ``[N, N]`` with ``mask[i, j]`` True iff ``j`` is ``i`` or an ancestor of ``i``.

    Row ``i`` is row ``parents[i]`` plus the diagonal; because parents come
    first, one pass in index order fills the matrix. The result is lower
    triangular.
    """
    num_nodes = parents.numel()
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=parents.device)
    parent_list = parents.tolist()
    for node in range(num_nodes):
        if parent_list[node] >= 0:
            mask[node] = mask[parent_list[node]]
        mask[node, node] = True
    return mask


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth ``[N]`` of each node (root has depth 0)."""
    return ancestor_or_self_mask(parents).sum(dim=1) - 1


def root_path(parents: torch.Tensor, node: int) -> list:
    """Node indices from the root down to ``node`` (inclusive)."""
    path = []
    parent_list = parents.tolist()
    while node >= 0:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def validate_accepted_path(
    accepted_path: IndexLike, parents: torch.Tensor, name: str = "accepted_path"
) -> torch.Tensor:
    """Check that ``accepted_path`` is ``[0, a1, ..., am]``: a root path of the tree.

    Each entry must be the child of the previous one, which also makes the
    indices strictly increasing.
    """
    path = as_index_tensor(accepted_path, name, parents.device)
    if path.numel() == 0 or int(path[0]) != 0:
        raise ValueError(f"{name} must have shape [m + 1] and start at the root node 0, got {path.tolist()}")
    if int(path.max()) >= parents.numel():
        raise ValueError(f"{name} entries must be < N = {parents.numel()}, got {path.tolist()}")
    if path.numel() > 1 and bool((parents[path[1:]] != path[:-1]).any()):
        raise ValueError(
            f"{name} must follow parent links from the root (parents[a_k] == a_(k-1)), got {path.tolist()}"
        )
    return path
