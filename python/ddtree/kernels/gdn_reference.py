r"""Exact, memory-bounded tree verification for Gated DeltaNet (GDN) layers.

Reference implementation in plain torch (CPU or GPU, fp32 or fp64) of what a
hybrid GDN target (Qwen3-Next, Qwen3.5 / Qwen3.6) must compute when it
verifies a DDTree draft tree in one forward pass. Conventions follow
transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``:

* a depthwise causal conv (width ``W``, usually 4) with SiLU over the
  concatenated ``[q | k | v]`` projections ("conv inputs", ``C`` channels);
* q and k l2-normalised (``x * rsqrt(sum(x^2) + 1e-6)``), q scaled by
  ``1 / sqrt(Dk)``;
* ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay, <= 0) and
  ``beta = sigmoid(b)`` per value head;
* grouped heads: value head ``h`` reads key head ``h // (Hv // Hk)``
  (``repeat_interleave``);
* recurrent state ``S`` of shape ``[Hv, Dk, Dv]`` kept in fp32 (or fp64).

Per token along a chain the rule is::

    S <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)        # the "delta" written into S
    S <- S + k_t u_t^T
    o_t = S^T q_t

Tree form (why it is exact)
---------------------------
Let ``P(i)`` be node ``i``'s root path (ancestors and itself) and
``G_i = sum_{l in P(i)} g_l`` (so ``G_i = G_parent(i) + g_i``). Unrolling the
rule along ``P(i)`` from the committed state ``S_0`` gives, by induction::

    S_i = exp(G_i) S_0 + sum_{j in P(i)} exp(G_i - G_j) k_j u_j^T

and therefore::

    u_i = beta_i (v_i - exp(G_i) S_0^T k_i
                  - sum_{j in P(i), j != i} exp(G_i - G_j) (k_i . k_j) u_j)
    o_i = exp(G_i) S_0^T q_i + sum_{j in P(i)} exp(G_i - G_j) (q_i . k_j) u_j

``u_i`` depends only on ``P(i)``, so it is one well-defined vector per node,
shared by every branch through ``i``. Stacking the nodes gives
``(I + L) U = diag(beta) (V - diag(exp G) K S_0)`` with
``L[i, j] = beta_i exp(G_i - G_j) k_i . k_j`` for strict ancestors ``j`` of
``i`` and 0 elsewhere. Ancestors have smaller indices, so ``L`` is strictly
lower triangular and one unit-triangular solve yields ``U``. This is the
chunked delta rule's UT/WY transform with the causal mask replaced by the
ancestor mask and the cumulative gate taken along root paths; for a chain it
reduces exactly to one chunk of ``torch_chunk_gated_delta_rule``.

Working memory per (key or value) head is ``O(N^2 + N d)``: the decay, Gram
and system matrices are ``N x N`` and no per-node ``Dk x Dv`` state is ever
formed. Only the request's committed state ``S_0`` is read.

Commit
------
After the target accepts the root path ``[0, a1, ..., am]`` the new state is
the one after ``am``. Two exact ways, neither needs per-node snapshots:

* WY commit (:func:`commit_recurrent_state`): from the cached per-node keys,
  deltas ``u`` and cumulative decays ``G`` (``TreeDeltaRuleCache``),
  ``S_new = exp(G_am) S_0 + sum_{j in path} exp(G_am - G_j) k_j u_j^T`` --
  one ``[Dk, m+1] @ [m+1, Dv]`` product per head, no sequential work;
* replay (:func:`replay_recurrent_state`): rerun the chain rule on the
  ``m + 1 <= L + 1`` accepted tokens only.

The conv history is the last ``W - 1`` conv inputs of ``old history + path``
(:func:`commit_conv_history`). :func:`verification_memory_bytes` prices both
commit strategies against state snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .topology import (
    IndexLike,
    ancestor_or_self_mask,
    validate_accepted_path,
    validate_batched_parents,
    validate_node_offsets,
    validate_parents,
)

L2NORM_EPS = 1e-6  # same epsilon as transformers' / FLA's l2norm


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)``, the exact formula GDN kernels use."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """GDN math runs in at least fp32 (bf16 inputs are upcast, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _require_shape(name: str, tensor: torch.Tensor, expected: Sequence[int], meaning: str) -> None:
    if list(tensor.shape) != list(expected):
        raise ValueError(f"{name} must have shape {meaning} = {list(expected)}, got {list(tensor.shape)}")


def _require_dim(name: str, tensor: torch.Tensor, ndim: int, meaning: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have shape {meaning} ({ndim}-D), got {list(tensor.shape)}")


# --------------------------------------------------------------------------
# 1. Tree causal conv
# --------------------------------------------------------------------------


def _conv_window_indices(parents: torch.Tensor, node_offsets: torch.Tensor, history_len: int) -> torch.Tensor:
    """Gather indices ``[T, W]`` of each node's conv window, newest first.

    Indices point into ``cat(all requests' histories, all nodes)``: history
    row ``j`` of request ``r`` is ``r * history_len + j`` and node ``t`` is
    ``R * history_len + t``. Every entry gets a "previous input" link -- a
    node's parent, the root's previous input is its request's newest history
    row, history row ``j``'s is row ``j - 1`` -- and the window is that link
    followed ``W - 1`` times. A root-path shorter than ``W - 1`` therefore
    runs into the history exactly like an ordinary causal conv would.
    """
    num_requests = node_offsets.numel() - 1
    num_nodes = parents.numel()
    device = parents.device
    history_rows = num_requests * history_len
    request_of_node = torch.repeat_interleave(
        torch.arange(num_requests, device=device), node_offsets[1:] - node_offsets[:-1]
    )

    node_prev = torch.where(
        parents >= 0,
        history_rows + node_offsets[request_of_node] + parents,
        request_of_node * history_len + history_len - 1,
    )
    # history row j -> j - 1; row 0 of a request is never followed (windows are W - 1 steps long).
    history_prev = torch.arange(history_rows, device=device) - 1
    previous_input = torch.cat([history_prev, node_prev])

    window = [history_rows + torch.arange(num_nodes, device=device)]
    for _ in range(history_len):
        window.append(previous_input[window[-1]])
    return torch.stack(window, dim=1)


def tree_causal_conv1d_batched(
    x_nodes: torch.Tensor,
    conv_history: torch.Tensor,
    parents: IndexLike,
    node_offsets: IndexLike,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over several requests' draft trees.

    Args:
        x_nodes: conv inputs of all nodes ``[T, C]`` (requests concatenated).
        conv_history: last ``W - 1`` committed conv inputs per request
            ``[R, W - 1, C]``, oldest first.
        parents: request-local parent indices ``[T]``.
        node_offsets: CSR offsets ``[R + 1]``.
        weight: depthwise kernel ``[C, W]`` (``conv1d.weight.squeeze(1)``),
            ``weight[:, -1]`` multiplies the newest input.
        bias: ``[C]`` or None.
        activation: ``"silu"`` (Qwen3-Next/3.5) or None.

    Returns:
        ``[T, C]`` in ``x_nodes.dtype``: node ``t`` equals the ordinary causal
        conv evaluated at ``t`` along ``history + root path of t``.
    """
    _require_dim("x_nodes", x_nodes, 2, "[T, C]")
    num_nodes, channels = x_nodes.shape
    _require_dim("weight", weight, 2, "[C, W]")
    _require_shape("weight", weight, [channels, weight.shape[1]], "[C, W]")
    kernel_width = weight.shape[1]
    offsets = validate_node_offsets(node_offsets, num_nodes, device=x_nodes.device)
    num_requests = offsets.numel() - 1
    _require_shape("conv_history", conv_history, [num_requests, kernel_width - 1, channels], "[R, W - 1, C]")
    if bias is not None:
        _require_shape("bias", bias, [channels], "[C]")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    local_parents = validate_batched_parents(parents, offsets, device=x_nodes.device)

    # Match transformers: compute in the conv weight's dtype, return the input dtype.
    compute = weight.dtype
    inputs = torch.cat([conv_history.reshape(-1, channels), x_nodes]).to(compute)
    window = _conv_window_indices(local_parents, offsets, kernel_width - 1)  # [T, W], newest first
    window_inputs = inputs[window.flip(1)]  # [T, W, C], oldest first like weight
    out = torch.einsum("twc,cw->tc", window_inputs, weight)
    if bias is not None:
        out = out + bias.to(compute)
    if activation is not None:
        out = F.silu(out)
    return out.to(x_nodes.dtype)


def tree_causal_conv1d(
    x_nodes: torch.Tensor,
    conv_history: torch.Tensor,
    parents: IndexLike,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over one draft tree.

    Args:
        x_nodes: ``[N, C]`` conv inputs of the tree's nodes.
        conv_history: ``[W - 1, C]`` last committed conv inputs, oldest first.
        parents: ``[N]``.
        weight: ``[C, W]``; bias ``[C]`` or None; activation ``"silu"`` or None.

    Returns:
        ``[N, C]``: node ``i``'s window is (newest first) ``i``, its parent,
        grandparent, ... and then the history once the root path runs out.
    """
    _require_dim("x_nodes", x_nodes, 2, "[N, C]")
    _require_dim("conv_history", conv_history, 2, "[W - 1, C]")
    parents = validate_parents(parents, device=x_nodes.device)
    if parents.numel() != x_nodes.shape[0]:
        raise ValueError(f"parents must have shape [N] = [{x_nodes.shape[0]}], got {list(parents.shape)}")
    offsets = torch.tensor([0, x_nodes.shape[0]], device=x_nodes.device)
    return tree_causal_conv1d_batched(x_nodes, conv_history[None], parents, offsets, weight, bias, activation)


def commit_conv_history(conv_history: torch.Tensor, x_nodes: torch.Tensor, accepted_path: IndexLike) -> torch.Tensor:
    """New conv history ``[W - 1, C]`` after accepting ``accepted_path`` (``[0, a1, ..., am]``).

    It is the last ``W - 1`` rows of ``cat(conv_history, x_nodes[path])``, so
    a path shorter than ``W - 1`` keeps the newest old-history rows in front.
    """
    _require_dim("conv_history", conv_history, 2, "[W - 1, C]")
    _require_dim("x_nodes", x_nodes, 2, "[N, C]")
    _require_shape("x_nodes", x_nodes, [x_nodes.shape[0], conv_history.shape[1]], "[N, C]")
    path = torch.as_tensor(accepted_path, device=x_nodes.device, dtype=torch.int64)
    history_len = conv_history.shape[0]
    if history_len == 0:
        return conv_history.clone()
    combined = torch.cat([conv_history, x_nodes[path].to(conv_history.dtype)])
    return combined[-history_len:].clone()


# --------------------------------------------------------------------------
# 2. Tree gated delta rule
# --------------------------------------------------------------------------


@dataclass
class TreeDeltaRuleCache:
    """What the tree pass keeps per node so a later commit needs no solve.

    Attributes (``T`` nodes of all requests, compute dtype):
        keys: l2-normalised keys ``[T, Hk, Dk]``.
        deltas: the ``u`` each node writes into the state ``[T, Hv, Dv]``.
        cumulative_log_decay: ``G`` summed along each root path ``[T, Hv]``.
        parents: request-local parents ``[T]``; node_offsets: ``[R + 1]``.
    """

    keys: torch.Tensor
    deltas: torch.Tensor
    cumulative_log_decay: torch.Tensor
    parents: torch.Tensor
    node_offsets: torch.Tensor

    def request(self, index: int) -> "TreeDeltaRuleCache":
        """The cache of one request (local node indices)."""
        start, end = int(self.node_offsets[index]), int(self.node_offsets[index + 1])
        return TreeDeltaRuleCache(
            keys=self.keys[start:end],
            deltas=self.deltas[start:end],
            cumulative_log_decay=self.cumulative_log_decay[start:end],
            parents=self.parents[start:end],
            node_offsets=torch.tensor([0, end - start], device=self.node_offsets.device),
        )


def _check_gdn_inputs(q, k, v, g, beta, num_nodes: int) -> Tuple[int, int, int, int]:
    """Validate q/k/v/g/beta shapes; return ``(Hk, Dk, Hv, Dv)``."""
    _require_dim("q", q, 3, "[N, Hk, Dk]")
    if q.shape[0] != num_nodes:
        raise ValueError(f"q must have shape [N, Hk, Dk] with N = {num_nodes} nodes, got {list(q.shape)}")
    _, num_k_heads, head_k_dim = q.shape
    _require_shape("k", k, list(q.shape), "[N, Hk, Dk] (same as q)")
    _require_dim("v", v, 3, "[N, Hv, Dv]")
    if v.shape[0] != num_nodes:
        raise ValueError(f"v must have shape [N, Hv, Dv] with N = {num_nodes} nodes, got {list(v.shape)}")
    _, num_v_heads, head_v_dim = v.shape
    if num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"v must have shape [N, Hv, Dv] with Hv a multiple of the key heads Hk = {num_k_heads} "
            f"(grouped value heads), got Hv = {num_v_heads}"
        )
    _require_shape("g", g, [num_nodes, num_v_heads], "[N, Hv]")
    _require_shape("beta", beta, [num_nodes, num_v_heads], "[N, Hv]")
    return num_k_heads, head_k_dim, num_v_heads, head_v_dim


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool, dtype: torch.dtype):
    """Upcast, optionally l2-normalise, and scale q by 1/sqrt(Dk) (as the model kernels do)."""
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k


def _tree_delta_rule_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    visible: torch.Tensor,
    initial_state: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree delta rule for one tree; inputs already prepared (see ``_prepare_qk``).

    Args:
        q, k: ``[N, Hk, Dk]`` (q scaled, both normalised); v: ``[N, Hv, Dv]``;
        g, beta: ``[N, Hv]``; all in the compute dtype.
        visible: bool ``[N, N]``, ``visible[i, j]`` iff j is i or an ancestor
            of i. Any lower-triangular mask with a true diagonal works; the
            causal mask gives the ordinary chunked delta rule.
        initial_state: ``[Hv, Dk, Dv]``.

    Returns:
        ``o [N, Hv, Dv]``, ``u [N, Hv, Dv]``, ``G [N, Hv]``.
    """
    num_nodes, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[1:]
    group = num_v_heads // num_k_heads
    dtype = v.dtype

    # Head-major layouts; value heads split as [key head, member of its group]
    # so the q.k and k.k Gram matrices are computed once per key head.
    q_heads = q.transpose(0, 1)  # [Hk, N, Dk]
    k_heads = k.transpose(0, 1)  # [Hk, N, Dk]
    v_heads = v.transpose(0, 1).reshape(num_k_heads, group, num_nodes, head_v_dim)
    g_heads = g.transpose(0, 1).reshape(num_k_heads, group, num_nodes)
    beta_heads = beta.transpose(0, 1).reshape(num_k_heads, group, num_nodes)
    state = initial_state.to(dtype).reshape(num_k_heads, group, head_k_dim, head_v_dim)

    # G_i = sum of g over the root path of i (ancestor-or-self rows of `visible`).
    cum_log_decay = g_heads @ visible.to(dtype).transpose(0, 1)  # [Hk, group, N]
    # decay[i, j] = exp(G_i - G_j) on the root path, 0 elsewhere. Masking before exp
    # matters: for unrelated nodes G_i - G_j can be large and positive.
    log_decay = cum_log_decay[..., :, None] - cum_log_decay[..., None, :]
    decay = log_decay.masked_fill(~visible, float("-inf")).exp()  # [Hk, group, N, N]

    key_gram = k_heads @ k_heads.transpose(-1, -2)  # [Hk, N, N]
    query_key = q_heads @ k_heads.transpose(-1, -2)  # [Hk, N, N]

    # (I + L) U = beta * (V - exp(G) K S_0), L strictly lower triangular on ancestors.
    strictly_ancestor = visible & ~torch.eye(num_nodes, dtype=torch.bool, device=visible.device)
    interaction = beta_heads[..., :, None] * decay * key_gram[:, None] * strictly_ancestor
    identity = torch.eye(num_nodes, dtype=dtype, device=v.device)
    initial_decay = cum_log_decay.exp()[..., None]  # exp(G_i), [Hk, group, N, 1]
    keys_read_state = torch.einsum("hnd,hgde->hgne", k_heads, state)  # S_0^T k_i
    rhs = beta_heads[..., None] * (v_heads - initial_decay * keys_read_state)
    deltas = torch.linalg.solve_triangular(identity + interaction, rhs, upper=False, unitriangular=True)

    queries_read_state = torch.einsum("hnd,hgde->hgne", q_heads, state)  # S_0^T q_i
    out = initial_decay * queries_read_state + (decay * query_key[:, None]) @ deltas

    def node_major(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(num_v_heads, num_nodes, -1).transpose(0, 1)

    return (
        node_major(out),
        node_major(deltas),
        cum_log_decay.reshape(num_v_heads, num_nodes).transpose(0, 1),
    )


def tree_gated_delta_rule_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: IndexLike,
    node_offsets: IndexLike,
    initial_states: torch.Tensor,
    use_qk_l2norm: bool = True,
    return_cache: bool = False,
):
    """Tree gated delta rule for several requests flattened vLLM-style.

    Args:
        q, k: ``[T, Hk, Dk]`` (raw; normalised here when ``use_qk_l2norm``).
        v: ``[T, Hv, Dv]`` with ``Hv % Hk == 0``.
        g: log decays ``[T, Hv]`` (<= 0); beta: ``[T, Hv]`` in (0, 1).
        parents: request-local parents ``[T]``; node_offsets: ``[R + 1]``.
        initial_states: committed states ``[R, Hv, Dk, Dv]``.
        return_cache: also return a :class:`TreeDeltaRuleCache` for commits.

    Returns:
        ``o [T, Hv, Dv]`` in ``q.dtype`` (and the cache): ``o[t]`` equals the
        sequential rule run along ``t``'s root path from its request's state.
        Requests are independent, so this loops over them; a fused kernel
        would give each (request, head) pair its own program.
    """
    _require_dim("q", q, 3, "[T, Hk, Dk]")
    num_nodes = q.shape[0]
    num_k_heads, head_k_dim, num_v_heads, head_v_dim = _check_gdn_inputs(q, k, v, g, beta, num_nodes)
    offsets = validate_node_offsets(node_offsets, num_nodes, device=q.device)
    local_parents = validate_batched_parents(parents, offsets, device=q.device)
    if local_parents.numel() != num_nodes:
        raise ValueError(f"parents must have shape [T] = [{num_nodes}], got {list(local_parents.shape)}")
    num_requests = offsets.numel() - 1
    _require_shape(
        "initial_states", initial_states, [num_requests, num_v_heads, head_k_dim, head_v_dim], "[R, Hv, Dk, Dv]"
    )

    dtype = _compute_dtype(torch.promote_types(q.dtype, initial_states.dtype))
    q_prepared, k_prepared = _prepare_qk(q, k, use_qk_l2norm, dtype)
    outputs, deltas, cum_log_decays = [], [], []
    for request in range(num_requests):
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        visible = ancestor_or_self_mask(local_parents[rows])
        out, delta, cum_log_decay = _tree_delta_rule_core(
            q_prepared[rows],
            k_prepared[rows],
            v[rows].to(dtype),
            g[rows].to(dtype),
            beta[rows].to(dtype),
            visible,
            initial_states[request],
        )
        outputs.append(out)
        deltas.append(delta)
        cum_log_decays.append(cum_log_decay)

    out = torch.cat(outputs).to(q.dtype)
    if not return_cache:
        return out
    cache = TreeDeltaRuleCache(
        keys=k_prepared,
        deltas=torch.cat(deltas),
        cumulative_log_decay=torch.cat(cum_log_decays),
        parents=local_parents,
        node_offsets=offsets,
    )
    return out, cache


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: IndexLike,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
    return_cache: bool = False,
):
    """Tree gated delta rule for one draft tree.

    Args:
        q, k: ``[N, Hk, Dk]``; v: ``[N, Hv, Dv]``; g, beta: ``[N, Hv]``.
        parents: ``[N]`` with ``parents[0] == -1`` and ``parents[i] < i``.
        initial_state: committed state ``[Hv, Dk, Dv]``.

    Returns:
        ``o [N, Hv, Dv]`` (and a :class:`TreeDeltaRuleCache` if
        ``return_cache``), equal to running the recurrent rule along each
        node's root path, without forming any per-node state.
    """
    _require_dim("q", q, 3, "[N, Hk, Dk]")
    parents = validate_parents(parents, device=q.device)
    if parents.numel() != q.shape[0]:
        raise ValueError(f"parents must have shape [N] = [{q.shape[0]}] (one per q row), got {list(parents.shape)}")
    _require_dim("initial_state", initial_state, 3, "[Hv, Dk, Dv]")
    offsets = torch.tensor([0, parents.numel()], device=q.device)
    return tree_gated_delta_rule_batched(
        q, k, v, g, beta, parents, offsets, initial_state[None], use_qk_l2norm, return_cache
    )


# --------------------------------------------------------------------------
# Chain (sequential) rule: oracle and replay commit
# --------------------------------------------------------------------------


def chain_gated_delta_rule(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """The plain token-by-token rule along a chain of ``L`` tokens.

    Args:
        q: ``[L, Hk, Dk]`` or None (then only the final state is computed);
        k: ``[L, Hk, Dk]``; v: ``[L, Hv, Dv]``; g, beta: ``[L, Hv]``;
        initial_state: ``[Hv, Dk, Dv]``.

    Returns:
        ``(o [L, Hv, Dv] in the compute dtype or None, final state [Hv, Dk, Dv])``.
    """
    num_tokens = k.shape[0]
    num_k_heads, head_k_dim, num_v_heads, head_v_dim = _check_gdn_inputs(
        q if q is not None else k, k, v, g, beta, num_tokens
    )
    _require_shape("initial_state", initial_state, [num_v_heads, head_k_dim, head_v_dim], "[Hv, Dk, Dv]")
    dtype = _compute_dtype(torch.promote_types(k.dtype, initial_state.dtype))
    q_prepared, k_prepared = _prepare_qk(q if q is not None else k, k, use_qk_l2norm, dtype)
    group = num_v_heads // num_k_heads
    # Grouped heads: value head h uses key head h // group.
    q_prepared = q_prepared.repeat_interleave(group, dim=1)
    k_prepared = k_prepared.repeat_interleave(group, dim=1)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)

    state = initial_state.to(dtype).clone()
    outputs = []
    for t in range(num_tokens):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hd,hde->he", k_prepared[t], state)  # S^T k_t
        delta = beta[t][:, None] * (v[t] - predicted)
        state = state + k_prepared[t][:, :, None] * delta[:, None, :]
        if q is not None:
            outputs.append(torch.einsum("hd,hde->he", q_prepared[t], state))
    out = torch.stack(outputs) if q is not None and num_tokens > 0 else None
    return out, state


# --------------------------------------------------------------------------
# 3. Commit
# --------------------------------------------------------------------------


def commit_recurrent_state(
    cache: TreeDeltaRuleCache, accepted_path: IndexLike, initial_state: torch.Tensor
) -> torch.Tensor:
    """State ``[Hv, Dk, Dv]`` after the last node of ``accepted_path``, from a one-request cache.

    ``S_new = exp(G_last) S_0 + sum_{j in path} exp(G_last - G_j) k_j u_j^T``
    (see the module docstring); ``accepted_path`` is ``[0, a1, ..., am]``.
    """
    if cache.node_offsets.numel() != 2:
        raise ValueError("cache must hold one request; use cache.request(r) or commit_gdn_state_batched")
    path = validate_accepted_path(accepted_path, cache.parents)
    num_k_heads, head_k_dim = cache.keys.shape[1:]
    num_v_heads, head_v_dim = cache.deltas.shape[1:]
    _require_shape("initial_state", initial_state, [num_v_heads, head_k_dim, head_v_dim], "[Hv, Dk, Dv]")
    group = num_v_heads // num_k_heads
    dtype = cache.deltas.dtype

    path_keys = cache.keys[path]  # [m, Hk, Dk]
    path_cum = cache.cumulative_log_decay[path]  # [m, Hv]
    last_cum = path_cum[-1]  # [Hv]
    weighted_deltas = (last_cum - path_cum).exp()[..., None] * cache.deltas[path]  # [m, Hv, Dv]
    weighted_deltas = weighted_deltas.reshape(-1, num_k_heads, group, head_v_dim)
    writes = torch.einsum("mhd,mhge->hgde", path_keys, weighted_deltas).reshape(num_v_heads, head_k_dim, head_v_dim)
    return last_cum.exp()[:, None, None] * initial_state.to(dtype) + writes


def replay_recurrent_state(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: IndexLike,
    accepted_path: IndexLike,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """State ``[Hv, Dk, Dv]`` after the accepted path, by rerunning the chain rule on it.

    Args are the tree pass's per-node ``k [N, Hk, Dk]``, ``v [N, Hv, Dv]``,
    ``g, beta [N, Hv]``, ``parents [N]``; only the ``m + 1`` path rows are read.
    """
    parents = validate_parents(parents, device=k.device)
    path = validate_accepted_path(accepted_path, parents)
    _, state = chain_gated_delta_rule(None, k[path], v[path], g[path], beta[path], initial_state, use_qk_l2norm)
    return state


def commit_gdn_state(
    conv_history: torch.Tensor,
    x_nodes: torch.Tensor,
    cache: TreeDeltaRuleCache,
    initial_state: torch.Tensor,
    accepted_path: IndexLike,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Commit one request: returns ``(recurrent state [Hv, Dk, Dv], conv history [W - 1, C])``.

    Args:
        conv_history: ``[W - 1, C]`` history the tree pass started from.
        x_nodes: ``[N, C]`` conv inputs of the tree's nodes.
        cache: the tree pass's one-request :class:`TreeDeltaRuleCache`.
        initial_state: ``[Hv, Dk, Dv]`` state the tree pass started from.
        accepted_path: ``[0, a1, ..., am]``.
    """
    validate_accepted_path(accepted_path, cache.parents)
    if x_nodes.shape[0] != cache.parents.numel():
        raise ValueError(f"x_nodes must have shape [N, C] with N = {cache.parents.numel()}, got {list(x_nodes.shape)}")
    state = commit_recurrent_state(cache, accepted_path, initial_state)
    history = commit_conv_history(conv_history, x_nodes, accepted_path)
    return state, history


def commit_gdn_state_batched(
    conv_history: torch.Tensor,
    x_nodes: torch.Tensor,
    cache: TreeDeltaRuleCache,
    initial_states: torch.Tensor,
    accepted_paths: Sequence[IndexLike],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Commit every request of a batched tree pass.

    Args:
        conv_history: ``[R, W - 1, C]``; x_nodes: ``[T, C]``;
        cache: from :func:`tree_gated_delta_rule_batched`;
        initial_states: ``[R, Hv, Dk, Dv]``;
        accepted_paths: R request-local paths, each ``[0, a1, ..., am]``.

    Returns:
        ``(states [R, Hv, Dk, Dv], conv histories [R, W - 1, C])``.
    """
    offsets = cache.node_offsets
    num_requests = offsets.numel() - 1
    if len(accepted_paths) != num_requests:
        raise ValueError(f"accepted_paths must hold R = {num_requests} paths, got {len(accepted_paths)}")
    _require_dim("conv_history", conv_history, 3, "[R, W - 1, C]")
    if conv_history.shape[0] != num_requests:
        raise ValueError(
            f"conv_history must have shape [R, W - 1, C] with R = {num_requests}, got {list(conv_history.shape)}"
        )
    _require_dim("initial_states", initial_states, 4, "[R, Hv, Dk, Dv]")
    states: List[torch.Tensor] = []
    histories: List[torch.Tensor] = []
    for request in range(num_requests):
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        state, history = commit_gdn_state(
            conv_history[request],
            x_nodes[rows],
            cache.request(request),
            initial_states[request],
            accepted_paths[request],
        )
        states.append(state)
        histories.append(history)
    return torch.stack(states), torch.stack(histories)


# --------------------------------------------------------------------------
# Memory accounting
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GdnModelShape:
    """The GDN dimensions that set memory costs (defaults: Qwen3.6-27B)."""

    num_gdn_layers: int = 48
    num_k_heads: int = 16
    num_v_heads: int = 48
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


QWEN3_6_27B_GDN = GdnModelShape()


def verification_memory_bytes(
    num_nodes: int,
    shape: GdnModelShape = QWEN3_6_27B_GDN,
    state_bytes: int = 4,
    activation_bytes: int = 2,
) -> dict:
    """Per-request bytes that tree verification keeps for the commit, all GDN layers.

    Keys:
        ``state_snapshot``: one recurrent state of every layer (what a
            request holds anyway).
        ``per_node_snapshots``: a state per tree node (the naive approach).
        ``wy_commit_cache``: :class:`TreeDeltaRuleCache` (keys, deltas, G in
            ``state_bytes``) plus the conv inputs (``activation_bytes``) --
            what :func:`commit_gdn_state` reads.
        ``replay_commit_cache``: conv inputs plus g and beta; the commit
            recomputes q/k/v of the <= L+1 path tokens with the conv and
            replays them (:func:`replay_recurrent_state`).
        ``intra_tree_workspace``: transient ``N x N`` matrices of one layer
            (decay and system per value head, two Gram matrices per key head);
            freed before the next layer runs.

    Qwen3.6-27B (fp32 state, bf16 conv inputs), in MB (1e6 bytes)::

        nodes  state_snapshot  per_node_snapshots  wy_commit_cache  replay_commit_cache  intra_tree_workspace
           16           151.0              2415.9             41.0                 16.0                   0.1
           64           151.0              9663.7            164.2                 64.1                   2.1
          256           151.0             38654.7            656.7                256.4                  33.6
    """
    per_layer_state = shape.num_v_heads * shape.head_k_dim * shape.head_v_dim * state_bytes
    snapshot = shape.num_gdn_layers * per_layer_state
    conv_inputs = shape.conv_channels * activation_bytes
    wy_per_node = (
        shape.num_k_heads * shape.head_k_dim * state_bytes  # normalised keys
        + shape.num_v_heads * shape.head_v_dim * state_bytes  # deltas u
        + shape.num_v_heads * state_bytes  # cumulative log decay G
        + conv_inputs
    )
    replay_per_node = conv_inputs + 2 * shape.num_v_heads * state_bytes  # + g and beta
    workspace = (2 * shape.num_v_heads + 2 * shape.num_k_heads) * num_nodes * num_nodes * state_bytes
    return {
        "state_snapshot": snapshot,
        "per_node_snapshots": num_nodes * snapshot,
        "wy_commit_cache": num_nodes * shape.num_gdn_layers * wy_per_node,
        "replay_commit_cache": num_nodes * shape.num_gdn_layers * replay_per_node,
        "intra_tree_workspace": workspace,
    }


def format_memory_table(node_counts: Sequence[int] = (16, 64, 256), shape: GdnModelShape = QWEN3_6_27B_GDN) -> str:
    """The table in :func:`verification_memory_bytes`'s docstring, in MB."""
    keys = ["state_snapshot", "per_node_snapshots", "wy_commit_cache", "replay_commit_cache", "intra_tree_workspace"]
    lines = ["nodes  " + "  ".join(keys)]
    for nodes in node_counts:
        costs = verification_memory_bytes(nodes, shape)
        cells = [f"{costs[key] / 1e6:>{len(key)}.1f}" for key in keys]
        lines.append(f"{nodes:>5}  " + "  ".join(cells))
    return "\n".join(lines)
