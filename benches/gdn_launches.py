"""Kernel launches of one GDN layer's tree verification and commit in vLLM's layout (CPU, Triton interpreter).

    TRITON_INTERPRET=1 python benches/gdn_launches.py

In eager mode every torch op and Triton kernel is a launch the host pays for, once per GDN layer and step
(48 layers at Qwen3.6-27B). This counts them for ``ddtree.vllm.gdn.verify_tree_tokens`` and
``commit_pending`` on a small batch of trees: torch ops that launch a kernel (views and metadata-only
ops excluded) and Triton kernel launches. Counts do not depend on the sizes, only on the code path.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the kernels run on CPU under Triton's interpreter)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
import _triton_interpreter  # noqa: E402

_triton_interpreter.patch_triton_interpreter_for_numpy2()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import ddtree  # noqa: E402
from ddtree.vllm.gdn import GdnCommitPlan, GdnTreeStep, commit_pending, verify_tree_tokens  # noqa: E402
from ddtree.vllm.step import acceptance_specs, layout_specs, numpy_arrays  # noqa: E402

# Ops that only make a new view or read metadata: no kernel on a GPU.
NO_LAUNCH = {
    "view",
    "_unsafe_view",
    "transpose",
    "t",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "as_strided",
    "expand",
    "alias",
    "detach",
    "reshape",
    "permute",
    "unsqueeze",
    "squeeze",
    "lift_fresh",
    "empty",
    "empty_strided",
    "empty_like",
    "_to_copy_noop",
}


class Launches(TorchDispatchMode):
    """Counts torch ops that launch a kernel, except those the Triton interpreter runs to stage a kernel's
    arguments (it copies them to and from host memory: a compiled launch does not)."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not self.in_kernel:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def count(fn):
    mode = Launches()
    triton_calls = []
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        triton_calls.append(self.fn.__name__)
        mode.in_kernel = True
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.in_kernel = False

    InterpretedFunction.run = run
    try:
        with mode:
            fn()
    finally:
        InterpretedFunction.run = original
    return mode.ops, triton_calls


def main() -> None:
    torch.manual_seed(0)
    heads_k, heads_v, dim, width = 2, 4, 16, 4
    channels = 2 * heads_k * dim + heads_v * dim
    budgets = [8, 15, 3]
    rng = np.random.default_rng(0)
    lp = np.sort(np.log(rng.dirichlet(np.ones(16), size=(len(budgets), 15))).astype(np.float32), axis=-1)[..., ::-1]
    ids = np.argsort(rng.random((len(budgets), 15, 16)), axis=-1).astype(np.int32)
    trees = ddtree.build_trees(np.ascontiguousarray(lp), ids, np.array(budgets))
    offsets = trees.node_offsets
    nodes = int(offsets[-1])
    words = (int(np.diff(offsets).max()) + 31) // 32
    layout = numpy_arrays(layout_specs(len(budgets), len(budgets), nodes, words, width - 1))
    ddtree.verify_layout_into(trees, np.arange(len(budgets)), 0, offsets[:-1], offsets[:-1], **layout)
    step = GdnTreeStep(
        token_index=torch.arange(nodes),
        other_index=None,
        node_offsets=torch.from_numpy(layout["node_offsets"]),
        ancestor_bits=torch.from_numpy(layout["ancestor_bits"]),
        conv_index=torch.from_numpy(layout["conv_index"]),
        num_requests=len(budgets),
        num_tree_tokens=nodes,
    )
    conv_state = torch.randn(6, width - 1, channels).transpose(1, 2)  # vLLM's "SD" layout
    ssm_state = torch.randn(6, heads_v, dim, dim) * 0.1
    slots = torch.tensor([[4], [1], [2]])[:, 0]  # a view, as vLLM's spec_state_indices_tensor[:, 0]
    x, a, b = torch.randn(nodes, channels), torch.randn(nodes, heads_v), torch.randn(nodes, heads_v)
    weight, bias = torch.randn(channels, width) * 0.5, torch.randn(channels) * 0.1
    a_log, dt_bias = torch.randn(heads_v) * 0.5, torch.randn(heads_v) * 0.5
    out = torch.empty(nodes, heads_v, dim)

    # (Older versions, for a before/after count from another checkout, took no ``out``.)
    takes_out = "out" in inspect.signature(verify_tree_tokens).parameters

    def verify():
        verify_tree_tokens(
            step,
            "layer.0",
            x,
            a,
            b,
            conv_state,
            ssm_state,
            slots,
            weight,
            bias,
            "silu",
            a_log,
            dt_bias,
            dim,
            dim,
            torch.float32,
            **({"out": out} if takes_out else {}),
        )

    # Request 1 accepts its first node, the others only their roots.
    targets = np.full(nodes, -1, dtype=np.int64)
    targets[offsets[1]] = trees.tokens[trees.token_offsets[1]]
    accepted = ddtree.accept_trees(trees, targets)
    after = numpy_arrays(acceptance_specs(accepted, accepted.output_tokens.shape[1], nodes, width - 1))
    ddtree.acceptance_layout_into(trees, accepted, offsets[:-1], **after)
    plan = GdnCommitPlan(
        node_offsets=step.node_offsets,
        paths=torch.from_numpy(after["paths"]),
        path_lengths=torch.from_numpy(after["path_lengths"]),
        conv_index=torch.from_numpy(after["commit_conv_index"]),
    )
    verify()  # the step's first layer converts the slots; later layers reuse them
    for name, fn in (("verify (a later layer of the step)", verify), ("commit", lambda: commit_pending(step, plan))):
        ops, kernels = count(fn)
        print(f"{name}: {len(ops)} torch launches {ops}, {len(kernels)} Triton launches {kernels}")


if __name__ == "__main__":
    main()
