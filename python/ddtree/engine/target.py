"""The target model run layer by layer for exact tree verification.

A transformers causal LM (dense Llama/Qwen3, hybrid Qwen3-Next/Qwen3.5) is not
called through its own ``forward``; :class:`TargetModel` walks its decoder
itself, reusing the modules' weights:

    embed -> per layer: input norm -> attention (HF module, our KV + tree mask)
                                   or GDN (ddtree.kernels tree conv + tree delta rule)
          -> residual -> post norm -> MLP/MoE (HF module) -> residual
    -> final norm -> lm_head

Every call verifies a *batch of trees* flattened the way vLLM flattens tokens:
request ``r`` contributes nodes ``[root, node 1, ..., node n_r]`` (root = its
last committed token, whose K/V and GDN update are not cached yet) at
positions ``cached_len_r + depth``. A prompt prefill is the same call with a
chain for a tree. Nothing is written to a request's caches until
:meth:`TargetModel.commit` is told which root path each request accepted:

* attention layers: every node's K/V is written to the slots after the
  committed ones, ``ddtree.kv_move_plan(path)`` moves the accepted nodes'
  K/V to consecutive slots, and the cache is cropped after them;
* GDN layers: ``commit_gdn_state`` computes the recurrent state after the
  path's last node and the conv history ending with it, from the committed
  state and what the tree pass cached; no per-node state is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ddtree
from ddtree.errors import DDTreeError
from ddtree.kernels.gdn_reference import (
    TreeDeltaRuleCache,
    commit_gdn_state_batched,
    tree_causal_conv1d_batched,
    tree_gated_delta_rule_batched,
)
from ddtree.kernels.kv_moves import apply_kv_moves


class UnsupportedModelError(DDTreeError, ValueError):
    """The target has a layer kind the reference engine cannot verify trees for."""


# --------------------------------------------------------------------------
# What one forward verifies
# --------------------------------------------------------------------------


@dataclass
class TreeInput:
    """One request's nodes for a forward pass.

    Attributes:
        tokens: int64 ``[N]``, node 0 is the root (the last committed token).
        parents: int64 ``[N]``, ``parents[0] == -1``, ``parents[i] < i``.
        positions: int64 ``[N]``, ``cached_len + depth``.
        visible: bool ``[N, N]``, ``visible[i, j]``: j is i or an ancestor of i.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def from_tree(cls, tree: ddtree.Tree, root_token: int, cached_len: int) -> "TreeInput":
        """A ``ddtree`` draft tree; positions and visibility come from ``compile_tree``."""
        compiled = ddtree.compile_tree(tree, start=cached_len)
        tokens = np.concatenate([[root_token], tree.tokens]).astype(np.int64)
        return cls(
            tokens=torch.from_numpy(tokens),
            parents=torch.from_numpy(tree.parents.astype(np.int64)),
            positions=torch.from_numpy(compiled.positions.astype(np.int64)),
            visible=torch.from_numpy(compiled.dense_mask()),
        )

    @classmethod
    def chain(cls, tokens: Sequence[int], cached_len: int) -> "TreeInput":
        """A chain (prefill chunk): causal visibility, consecutive positions."""
        count = len(tokens)
        return cls(
            tokens=torch.as_tensor(list(tokens), dtype=torch.int64),
            parents=torch.arange(-1, count - 1, dtype=torch.int64),
            positions=cached_len + torch.arange(count, dtype=torch.int64),
            visible=torch.ones(count, count, dtype=torch.bool).tril(),
        )

    def __len__(self) -> int:
        return int(self.tokens.numel())


# --------------------------------------------------------------------------
# Per-request committed state
# --------------------------------------------------------------------------


class SlotKVCache:
    """Slot-major K/V of one attention layer for one request: ``[capacity, Hkv, D]``.

    Slot ``i`` holds position ``i``; ``length`` slots are committed. A tree's
    nodes are written after them, then compacted by the accepted path's move
    plan -- the same slot arithmetic a paged cache does.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 64):
        self.keys = torch.zeros(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def committed(self):
        """``(keys, values)``, each ``[length, Hkv, D]`` (views)."""
        return self.keys[: self.length], self.values[: self.length]

    def _reserve(self, slots: int) -> None:
        if slots <= self.keys.shape[0]:
            return
        capacity = max(slots, 2 * self.keys.shape[0])
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(capacity, *old.shape[1:])
            grown[: self.length] = old[: self.length]
            setattr(self, name, grown)

    def commit_tree(self, node_keys: torch.Tensor, node_values: torch.Tensor, path: np.ndarray) -> None:
        """Write the nodes' ``[N, Hkv, D]`` K/V after the committed slots, keep the path's.

        ``kv_move_plan`` gives tree-local ``(src, dst)`` slot pairs that put
        accepted node ``path[k]`` at slot ``k``; slots past the path are then
        dropped by moving ``length``.
        """
        start, num_nodes = self.length, node_keys.shape[0]
        self._reserve(start + num_nodes)
        self.keys[start : start + num_nodes] = node_keys
        self.values[start : start + num_nodes] = node_values
        src, dst = ddtree.kv_move_plan(np.ascontiguousarray(path, dtype=np.int32))
        for cache in (self.keys, self.values):
            apply_kv_moves(cache, torch.from_numpy(src) + start, torch.from_numpy(dst) + start)
        self.length = start + len(path)


@dataclass
class GdnState:
    """Committed state of one GDN layer for one request.

    conv_history: ``[W - 1, C]`` last conv inputs, oldest first (zeros at start,
        like the zero left padding of a causal conv).
    recurrent: ``[Hv, Dk, Dv]`` fp32 delta-rule state.
    """

    conv_history: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class RequestState:
    """Everything the target has committed for one request."""

    kv: Dict[int, SlotKVCache]
    gdn: Dict[int, GdnState]
    cached_len: int = 0  # tokens whose K/V (and GDN updates) are in the caches


# --------------------------------------------------------------------------
# Forward output and pending commit
# --------------------------------------------------------------------------


@dataclass
class PendingCommit:
    """What a tree pass computed that the commit keeps (the accepted part of)."""

    node_offsets: torch.Tensor  # [R + 1]
    node_kv: Dict[int, tuple] = field(default_factory=dict)  # layer -> (K [T, Hkv, D], V)
    gdn_conv_inputs: Dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, C]
    gdn_caches: Dict[int, TreeDeltaRuleCache] = field(default_factory=dict)


@dataclass
class TreeForwardOutput:
    """Result of :meth:`TargetModel.forward_trees` for R requests, T nodes in all.

    logits: ``[T, V]`` fp32; row ``t`` is the next-token logits after node t's root path.
    features: ``[T, len(feature_layer_ids) * H]`` hidden states at the requested
        layers (HF ``hidden_states[l + 1]``), concatenated; None if none requested.
    node_offsets: ``[R + 1]`` CSR offsets of the requests' nodes.
    pending: for :meth:`TargetModel.commit`.
    """

    logits: torch.Tensor
    features: Optional[torch.Tensor]
    node_offsets: torch.Tensor
    pending: PendingCommit

    def request_rows(self, request: int) -> slice:
        return slice(int(self.node_offsets[request]), int(self.node_offsets[request + 1]))


# --------------------------------------------------------------------------
# Attention through the HF module
# --------------------------------------------------------------------------


class _VerificationKV:
    """Stands in for a transformers ``Cache`` during one flat forward.

    An HF attention module calls ``cache.update(k, v, layer_idx)`` with the new
    tokens' post-RoPE keys ``[1, Hkv, T, D]`` and attends over what it returns.
    This returns ``[every request's committed K/V, the new K/V]`` concatenated
    along the sequence and remembers the new K/V for the commit; the additive
    mask decides which of those keys each node sees.
    """

    def __init__(self, committed: Dict[int, tuple]):
        self.committed = committed  # layer -> (K [1, Hkv, S, D], V)
        self.new_kv: Dict[int, tuple] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_kv[layer_idx] = (key_states, value_states)
        old_keys, old_values = self.committed[layer_idx]
        return torch.cat([old_keys, key_states], dim=2), torch.cat([old_values, value_states], dim=2)


def _flat_attention_bias(trees: Sequence[TreeInput], prefix_lens: Sequence[int], dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, T, S + T]`` over keys ``[prefix_0 .. prefix_{R-1}, nodes]``.

    Node t of request r sees request r's whole committed prefix and its own
    ancestors-or-self; everything else is masked with the dtype's minimum (as
    transformers does, so a fully masked row could not produce NaN).
    """
    total_prefix = sum(prefix_lens)
    total_nodes = sum(len(tree) for tree in trees)
    visible = torch.zeros(total_nodes, total_prefix + total_nodes, dtype=torch.bool, device=device)
    prefix_start, node_start = 0, 0
    for tree, prefix_len in zip(trees, prefix_lens):
        rows = slice(node_start, node_start + len(tree))
        visible[rows, prefix_start : prefix_start + prefix_len] = True
        node_cols = slice(total_prefix + node_start, total_prefix + node_start + len(tree))
        visible[rows, node_cols] = tree.visible.to(device)
        prefix_start += prefix_len
        node_start += len(tree)
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias.masked_fill_(~visible, torch.finfo(dtype).min)
    return bias[None, None]


# --------------------------------------------------------------------------
# GDN through ddtree.kernels
# --------------------------------------------------------------------------


def gdn_input_projections(layer: nn.Module, hidden: torch.Tensor):
    """A GDN layer's projections of ``hidden [T, H]``.

    Returns conv inputs ``[T, C]`` (q | k | v channels in the order the layer's
    own conv sees them), ``z [T, Hv, Dv]``, ``b [T, Hv]``, ``a [T, Hv]``.
    Qwen3-Next packs q/k/v/z per key-head group in one projection; Qwen3.5
    has separate projections.
    """
    num_tokens = hidden.shape[0]
    if hasattr(layer, "in_proj_qkvz"):
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden[None]), layer.in_proj_ba(hidden[None])
        )
        conv_inputs = torch.cat([t.reshape(num_tokens, -1) for t in (query[0], key[0], value[0])], dim=-1)
        return conv_inputs, z[0], b[0], a[0]
    z = layer.in_proj_z(hidden).reshape(num_tokens, -1, layer.head_v_dim)
    return layer.in_proj_qkv(hidden), z, layer.in_proj_b(hidden), layer.in_proj_a(hidden)


# --------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------


#: The engine calls the HF attention and rotary modules directly; their calling
#: conventions changed within 5.x (5.17 fails: measured on the H200 image).
MIN_TRANSFORMERS = (5, 24)


def require_supported_transformers() -> None:
    """Refuses transformers versions whose module interfaces the engine does not match."""
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if found < MIN_TRANSFORMERS:
        wanted = ".".join(map(str, MIN_TRANSFORMERS))
        raise RuntimeError(
            f"ddtree.engine needs transformers >= {wanted}, found {transformers.__version__}: "
            "it drives the models' attention and rotary modules directly, and their interfaces changed"
        )


class TargetModel:
    """A transformers causal LM driven layer by layer for tree verification.

    Args:
        model: e.g. ``Qwen3ForCausalLM``, ``LlamaForCausalLM``,
            ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` (in eval mode).
    """

    def __init__(self, model: nn.Module):
        require_supported_transformers()
        self.model = model.eval()
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.embed_tokens = decoder.embed_tokens
        self.layers = decoder.layers
        self.final_norm = decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.attention_layers: List[int] = []
        self.gdn_layers: List[int] = []
        for index, layer in enumerate(self.layers):
            self._classify_layer(index, layer)

    def _classify_layer(self, index: int, layer: nn.Module) -> None:
        if hasattr(layer, "linear_attn"):
            self.gdn_layers.append(index)
        elif hasattr(layer, "self_attn"):
            if getattr(layer.self_attn, "sliding_window", None):
                raise UnsupportedModelError(f"layer {index}: sliding-window attention is not supported")
            self.attention_layers.append(index)
        else:
            raise UnsupportedModelError(f"layer {index} ({type(layer).__name__}) has neither self_attn nor linear_attn")

    # ---------------------------------------------------------------- shapes

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_request_state(self) -> RequestState:
        """Empty caches for a new request."""
        kv = {}
        for index in self.attention_layers:
            attn = self.layers[index].self_attn
            num_kv_heads = attn.k_proj.out_features // attn.head_dim
            kv[index] = SlotKVCache(num_kv_heads, attn.head_dim, self.dtype, self.device)
        gdn = {}
        for index in self.gdn_layers:
            layer = self.layers[index].linear_attn
            gdn[index] = GdnState(
                conv_history=torch.zeros(
                    layer.conv_kernel_size - 1, layer.conv_dim, dtype=self.dtype, device=self.device
                ),
                recurrent=torch.zeros(
                    layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=torch.float32, device=self.device
                ),
            )
        return RequestState(kv=kv, gdn=gdn)

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def forward_trees(
        self,
        states: Sequence[RequestState],
        trees: Sequence[TreeInput],
        feature_layer_ids: Sequence[int] = (),
    ) -> TreeForwardOutput:
        """Verify one tree per request in one flat forward; caches are not modified.

        ``trees[r]``'s positions must start at ``states[r].cached_len``.
        """
        if len(states) != len(trees) or not trees:
            raise ValueError(f"need one tree per request, got {len(trees)} trees for {len(states)} states")
        for state, tree in zip(states, trees):
            if int(tree.positions[0]) != state.cached_len:
                raise ValueError(f"tree root position {int(tree.positions[0])} != cached length {state.cached_len}")
        device = self.device
        sizes = torch.tensor([len(tree) for tree in trees])
        node_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        tokens = torch.cat([tree.tokens for tree in trees]).to(device)
        positions = torch.cat([tree.positions for tree in trees]).to(device)

        hidden = self.embed_tokens(tokens)[None]  # [1, T, H]
        position_embeddings = self.rotary_emb(hidden, positions[None])
        attention_bias = _flat_attention_bias(trees, [s.cached_len for s in states], hidden.dtype, device)
        kv_view = _VerificationKV(self._committed_kv(states))
        pending = PendingCommit(node_offsets=node_offsets)

        wanted = {layer_id: None for layer_id in feature_layer_ids}
        for index, layer in enumerate(self.layers):
            residual = hidden
            mixer_input = layer.input_layernorm(hidden)
            if index in self.gdn_layers:
                mixed = self._gdn_tree(index, layer.linear_attn, mixer_input[0], states, trees, node_offsets, pending)[
                    None
                ]
            else:
                mixed, _ = layer.self_attn(
                    hidden_states=mixer_input,
                    position_embeddings=position_embeddings,
                    attention_mask=attention_bias,
                    cache=kv_view,
                )
            hidden = residual + mixed
            residual = hidden
            mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
            if isinstance(mlp_out, tuple):  # some MoE blocks also return router logits
                mlp_out = mlp_out[0]
            hidden = residual + mlp_out
            if index in wanted:
                wanted[index] = hidden[0]

        hidden = self.final_norm(hidden)
        # transformers' hidden_states[-1] is the *normed* last layer output; match it.
        if self.num_layers - 1 in wanted:
            wanted[self.num_layers - 1] = hidden[0]
        logits = self.lm_head(hidden[0]).float()

        for index, (keys, values) in kv_view.new_kv.items():
            # [1, Hkv, T, D] -> slot-major [T, Hkv, D]
            pending.node_kv[index] = (keys[0].transpose(0, 1), values[0].transpose(0, 1))
        features = torch.cat([wanted[i] for i in feature_layer_ids], dim=-1) if feature_layer_ids else None
        return TreeForwardOutput(logits=logits, features=features, node_offsets=node_offsets, pending=pending)

    def _committed_kv(self, states: Sequence[RequestState]) -> Dict[int, tuple]:
        """Per attention layer, all requests' committed K/V as ``[1, Hkv, S, D]``."""
        committed = {}
        for index in self.attention_layers:
            keys = torch.cat([state.kv[index].committed()[0] for state in states])
            values = torch.cat([state.kv[index].committed()[1] for state in states])
            committed[index] = (keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
        return committed

    def _gdn_tree(self, index, layer, hidden, states, trees, node_offsets, pending) -> torch.Tensor:
        """A GDN layer on the flat nodes ``hidden [T, H]`` -> ``[T, H]``.

        The tree conv reads each node's conv window along its root path (then
        the committed history); the tree delta rule runs from each request's
        committed recurrent state. Both are exact for every root path.
        (``compile_tree``'s ``windows`` name the same conv windows; the torch
        reference derives them from ``parents``, a fused kernel would read them.)
        """
        num_nodes = hidden.shape[0]
        parents = torch.cat([tree.parents for tree in trees]).to(hidden.device)
        conv_inputs, z, b, a = gdn_input_projections(layer, hidden)
        conv_history = torch.stack([state.gdn[index].conv_history for state in states])
        conv_out = tree_causal_conv1d_batched(
            conv_inputs,
            conv_history,
            parents,
            node_offsets,
            layer.conv1d.weight.squeeze(1),
            layer.conv1d.bias,
            activation=layer.activation,
        )
        query, key, value = torch.split(conv_out, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        query = query.reshape(num_nodes, -1, layer.head_k_dim)
        key = key.reshape(num_nodes, -1, layer.head_k_dim)
        value = value.reshape(num_nodes, -1, layer.head_v_dim)
        beta = b.sigmoid()
        # Same formula and fp32 upcast as the HF layer (A_log may be bf16).
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        initial_states = torch.stack([state.gdn[index].recurrent for state in states])
        core, cache = tree_gated_delta_rule_batched(
            query, key, value, g, beta, parents, node_offsets, initial_states, return_cache=True
        )
        pending.gdn_conv_inputs[index] = conv_inputs
        pending.gdn_caches[index] = cache
        core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
        return layer.out_proj(core.reshape(num_nodes, -1))

    # ---------------------------------------------------------------- commit

    @torch.no_grad()
    def commit(self, states: Sequence[RequestState], output: TreeForwardOutput, paths: Sequence[np.ndarray]) -> None:
        """Keep each request's accepted root path ``[0, a1, ..., am]`` of the last forward."""
        pending = output.pending
        if len(paths) != len(states):
            raise ValueError(f"need one accepted path per request, got {len(paths)} for {len(states)}")
        for request, (state, path) in enumerate(zip(states, paths)):
            rows = output.request_rows(request)
            for index, (keys, values) in pending.node_kv.items():
                state.kv[index].commit_tree(keys[rows], values[rows], path)
        torch_paths = [torch.as_tensor(np.asarray(p), dtype=torch.int64) for p in paths]
        for index in self.gdn_layers:
            recurrent, history = commit_gdn_state_batched(
                torch.stack([state.gdn[index].conv_history for state in states]),
                pending.gdn_conv_inputs[index],
                pending.gdn_caches[index],
                torch.stack([state.gdn[index].recurrent for state in states]),
                torch_paths,
            )
            for request, state in enumerate(states):
                state.gdn[index] = GdnState(conv_history=history[request], recurrent=recurrent[request].float())
        for state, path in zip(states, paths):
            state.cached_len += len(path)


def load_causal_lm(directory: str, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM.from_pretrained(directory)`` with the checkpoint's config read by transformers' own
    config class for its model type.

    Building a vLLM engine config registers vLLM's own config classes for some model types (``qwen3_5`` among
    them) with transformers' ``AutoConfig``; from then on ``AutoModelForCausalLM`` reads such a checkpoint into
    vLLM's class and fails to build the model ("Qwen3_5Config has no attribute vocab_size") in that process.
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(directory).model_type
    native = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    config = native.from_pretrained(directory) if native is not None else None
    return AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype)
