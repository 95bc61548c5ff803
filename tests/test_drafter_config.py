"""Sliding-window drafter layers: the vLLM adapter refuses them before loading (ddtree.drafter_config); the
reference engine runs them as trained (causal, windowed)."""

import json
import shutil
from pathlib import Path

import pytest

from ddtree.drafter_config import check_drafter_layers, sliding_window_layers

PAIR_DRAFTER = Path(__file__).resolve().parent / "fixtures" / "models" / "drafter"
RELEASED_27B = ["sliding_attention"] * 4 + ["full_attention"]  # the Qwen3.6-27B DFlash drafter's layer_types


def test_which_layers_slide():
    assert sliding_window_layers(RELEASED_27B) == [0, 1, 2, 3]
    assert sliding_window_layers(RELEASED_27B, use_sliding_window=False) == []  # Qwen's off switch
    assert sliding_window_layers(["full_attention"] * 5) == [] and sliding_window_layers(None) == []
    check_drafter_layers("x", ["full_attention"] * 5, True)  # nothing to refuse


@pytest.mark.parametrize("switch", [True, False, None])
def test_the_vllm_adapter_refuses_sliding_layers_whatever_the_switch_says(switch):
    """vLLM's DFlash drafter reads layer_types alone (it refuses a mixed drafter after the target has loaded):
    transformers turns the switch off for a config without ``use_sliding_window: true``, which must not let the
    drafter through to that late refusal."""
    from ddtree.drafter_config import UnsupportedDrafterError

    with pytest.raises(
        UnsupportedDrafterError, match=r"sliding-window attention layers \(\[0, 1, 2, 3\] of 5"
    ) as error:
        check_drafter_layers("the drafter", RELEASED_27B, switch)
    assert ("use_sliding_window is off" in str(error.value)) == (switch is False)


def test_the_reference_engine_loads_a_sliding_window_drafter_with_its_layers_as_trained(tmp_path):
    pytest.importorskip("torch")
    from ddtree.engine import DFlashDraftModel

    drafter = tmp_path / "drafter"
    shutil.copytree(PAIR_DRAFTER, drafter)
    config = json.loads((drafter / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    config.update(layer_types=kinds, use_sliding_window=True, sliding_window=2048)
    (drafter / "config.json").write_text(json.dumps(config))
    model = DFlashDraftModel.from_pretrained(str(drafter))
    attention = [(layer.self_attn.causal, layer.self_attn.window) for layer in model.layers]
    assert attention == [(True, 2048)] * (layers - 1) + [(False, None)]
