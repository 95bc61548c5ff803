"""One published object per step carries the trees to vLLM's layers (attention builder, GDN layers)."""

from types import SimpleNamespace

import torch

from ddtree.vllm import context, patches
from ddtree.vllm.graphs import TreeStepBuffers

CPU = torch.device("cpu")


def _runner(conv_window):
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = SimpleNamespace(_ddtree_conv_window=conv_window, _ddtree_gdn_step=None)
    runner.publish = lambda *args: DDTreeGPUModelRunner._ddtree_publish(runner, *args)
    return runner


def _layout(conv_width):
    buffers = TreeStepBuffers(CPU, max_requests=2, max_tokens=10, tree_size=5, conv_width=conv_width)
    return buffers.stage_dummy_trees(2, depth=2)


def test_the_runner_publishes_attention_and_gdn_inputs_as_one_step_and_keeps_the_gdn_step():
    runner = _runner(conv_window=3)
    layout = _layout(conv_width=4)
    step = runner.publish(layout, 2, 10, torch.arange(10), None, 2)
    published = context.published()
    try:
        assert published.gdn is step is runner._ddtree_gdn_step
        assert published.attention.row_start is layout["row_start"]
        assert published.attention.ancestor_bits is layout["ancestor_bits"] is step.ancestor_bits
        assert (published.attention.num_reqs, published.attention.num_tokens) == (2, 10)
        context.withdraw()
        assert context.published() is None
        assert runner._ddtree_gdn_step is step  # the commit after acceptance still finds it
    finally:
        context.withdraw()


def test_an_attention_only_target_publishes_no_gdn_step():
    runner = _runner(conv_window=0)
    try:
        assert runner.publish(_layout(conv_width=0), 2, 10, torch.arange(10), None, 2) is None
        assert context.published().gdn is None and context.published().attention.num_tokens == 10
    finally:
        context.withdraw()


def test_gdn_layers_take_the_tree_path_only_while_a_gdn_step_is_published(monkeypatch):
    calls = []
    monkeypatch.setattr(patches, "_gdn_forward_core_with_trees", lambda layer, original, step, *a: calls.append(step))
    original = lambda self, *a: calls.append("vllm")  # noqa: E731
    forward = patches._tree_aware_forward_core(original)
    forward(None, 1, 2, 3, 4)
    runner = _runner(conv_window=0)
    runner.publish(_layout(conv_width=0), 2, 10, torch.arange(10), None, 2)
    forward(None, 1, 2, 3, 4)  # a tree step of an attention-only target: vLLM's own GDN path (none to run)
    gdn = _runner(conv_window=3).publish(_layout(conv_width=4), 2, 10, torch.arange(10), None, 2)
    forward(None, 1, 2, 3, 4)
    context.withdraw()
    forward(None, 1, 2, 3, 4)
    assert calls == ["vllm", "vllm", gdn, "vllm"]
