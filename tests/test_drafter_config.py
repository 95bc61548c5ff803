"""Drafters ddtree cannot run as trained are refused before their weights load (ddtree.drafter_config)."""

import json
import shutil
from pathlib import Path

import pytest

from ddtree.drafter_config import UnsupportedDrafterError, check_drafter_layers, sliding_window_layers

PAIR_DRAFTER = Path(__file__).resolve().parent / "fixtures" / "models" / "drafter"
RELEASED_27B = ["sliding_attention"] * 4 + ["full_attention"]  # the Qwen3.6-27B DFlash drafter's layer_types


def test_which_layers_slide():
    assert sliding_window_layers(RELEASED_27B) == [0, 1, 2, 3]
    assert sliding_window_layers(RELEASED_27B, use_sliding_window=False) == []  # Qwen's off switch
    assert sliding_window_layers(["full_attention"] * 5) == [] and sliding_window_layers(None) == []
    check_drafter_layers("x", ["full_attention"] * 5, True)  # nothing to refuse


def test_the_reference_engine_refuses_a_sliding_window_drafter(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841
    from ddtree.engine import DFlashDraftModel

    drafter = tmp_path / "drafter"
    shutil.copytree(PAIR_DRAFTER, drafter)
    config = json.loads((drafter / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(layer_types=["sliding_attention"] * layers, use_sliding_window=True, sliding_window=2048)
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedDrafterError, match=r"config.json: the drafter has sliding-window attention layers"):
        DFlashDraftModel.from_pretrained(str(drafter))
    assert DFlashDraftModel.from_pretrained(str(PAIR_DRAFTER)) is not None  # the pair's drafter is all full
