"""Shared helpers for the GDN tree tests: random trees, random GDN inputs, oracles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from ddtree.kernels.gdn_reference import chain_gated_delta_rule
from ddtree.kernels.topology import root_path


#: The transformers whose Qwen3-Next / Qwen3.5 layers the GDN tests take as their oracle: the reference engine's
#: (pyproject's ``torch`` extra). An older one's recurrent rule lacks what they use (on the GPU image's 5.17: a shape
#: error inside ``modeling_qwen3_next``, ``gpu-h100-e2e-117fa17``).
REFERENCE_TRANSFORMERS = (5, 24)


def skip_below_reference_transformers() -> None:
    """Skips the calling test module, naming both versions, where transformers is older than the oracle needs."""
    import pytest
    import transformers

    have = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if have < REFERENCE_TRANSFORMERS:
        need = ".".join(map(str, REFERENCE_TRANSFORMERS))
        pytest.skip(
            f"transformers {transformers.__version__} is older than the oracle's {need}", allow_module_level=True
        )


def chain_parents(num_nodes: int) -> list:
    return [-1] + list(range(num_nodes - 1))


def star_parents(num_nodes: int) -> list:
    return [-1] + [0] * (num_nodes - 1)


def random_parents(num_nodes: int, generator: torch.Generator) -> list:
    """Each node picks a uniformly random earlier node as parent."""
    return [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, num_nodes)]


@st.composite
def tree_parents(draw, max_nodes: int = 64) -> list:
    """Hypothesis strategy: chains, stars and random topologically ordered trees."""
    num_nodes = draw(st.integers(min_value=1, max_value=max_nodes))
    kind = draw(st.sampled_from(["random", "chain", "star", "deep"]))
    if kind == "chain":
        return chain_parents(num_nodes)
    if kind == "star":
        return star_parents(num_nodes)
    if kind == "deep":  # parents close to the node: long branches like real draft trees
        return [-1] + [
            draw(st.integers(min_value=max(0, node - 3), max_value=node - 1)) for node in range(1, num_nodes)
        ]
    return [-1] + [draw(st.integers(min_value=0, max_value=node - 1)) for node in range(1, num_nodes)]


def leaves(parents: list) -> list:
    has_child = set(p for p in parents if p >= 0)
    return [node for node in range(len(parents)) if node not in has_child]


def random_gdn_inputs(
    num_nodes: int,
    num_k_heads: int = 2,
    num_v_heads: int = 6,
    head_k_dim: int = 16,
    head_v_dim: int = 8,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> dict:
    """Inputs at realistic scales: raw q/k (normalised inside), g = -exp(A_log) softplus(.), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    # Decay rates spread log-uniformly from long memory (exp(g) ~ 0.999) to fast forgetting (exp(g) ~ 0.3).
    a_log = torch.empty(num_v_heads, dtype=torch.float64).uniform_(-7.0, 1.0, generator=gen)
    g = -a_log.exp() * F.softplus(randn(num_nodes, num_v_heads).double())
    return {
        "q": randn(num_nodes, num_k_heads, head_k_dim),
        "k": randn(num_nodes, num_k_heads, head_k_dim),
        "v": randn(num_nodes, num_v_heads, head_v_dim),
        "g": g.to(dtype),
        "beta": torch.sigmoid(randn(num_nodes, num_v_heads)),
        "initial_state": randn(num_v_heads, head_k_dim, head_v_dim) * 0.5,
    }


def root_path_outputs_by_chain(inputs: dict, parents: list) -> torch.Tensor:
    """Oracle: run the sequential rule along every root-to-leaf path; each node's output is taken
    from a path through it (all paths through a node give it the same output)."""
    parents_tensor = torch.tensor(parents)
    num_nodes = len(parents)
    num_v_heads, _, head_v_dim = inputs["initial_state"].shape
    out = torch.full((num_nodes, num_v_heads, head_v_dim), float("nan"), dtype=torch.float64)
    for leaf in leaves(parents):
        path = root_path(parents_tensor, leaf)
        path_out, _ = chain_gated_delta_rule(
            inputs["q"][path],
            inputs["k"][path],
            inputs["v"][path],
            inputs["g"][path],
            inputs["beta"][path],
            inputs["initial_state"],
        )
        out[path] = path_out.double()
    return out


def reference_causal_conv(x_sequence: torch.Tensor, weight: torch.Tensor, bias, activation: bool) -> torch.Tensor:
    """Ordinary causal depthwise conv of a whole sequence ``[L, C]`` with zero left padding, via F.conv1d."""
    width = weight.shape[1]
    out = F.conv1d(x_sequence.T[None], weight[:, None, :], bias, padding=width - 1, groups=x_sequence.shape[1])
    out = out[0, :, : x_sequence.shape[0]].T
    return F.silu(out) if activation else out


def root_path_outputs_by_state_walk(inputs: dict, parents: list) -> torch.Tensor:
    """Same oracle, memoised: node i's state is one sequential step from its parent's state (the rule is
    Markov), so O(N) steps instead of one chain per leaf. Materialises every node's state: tests only."""
    states = []
    outputs = []
    for node, parent in enumerate(parents):
        start = inputs["initial_state"] if parent < 0 else states[parent]
        out, state = chain_gated_delta_rule(
            *(inputs[name][node : node + 1] for name in ("q", "k", "v", "g", "beta")), start
        )
        states.append(state)
        outputs.append(out[0].double())
    return torch.stack(outputs)
