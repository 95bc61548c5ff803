"""The pair's target still loads with transformers in a process where vLLM registered its own config classes
(vLLM does so while it builds an engine config; ``AutoModelForCausalLM`` then fails on a Qwen3.5 checkpoint)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ddtree.vllm.patches import vllm_below  # noqa: E402

TARGET = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "target"

CHILD = f"""
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from vllm.transformers_utils.config import _maybe_register_hf_config
from ddtree.engine.target import load_causal_lm

_maybe_register_hf_config(AutoConfig.from_pretrained({str(TARGET)!r}))  # what vLLM's get_config does
try:
    AutoModelForCausalLM.from_pretrained({str(TARGET)!r}, dtype=torch.float32)
    print("auto: loaded")
except AttributeError as error:
    print("auto: failed:", error)
model = load_causal_lm({str(TARGET)!r}, torch.float32)
print("ddtree:", type(model).__name__, model.config.get_text_config().vocab_size)
"""


def test_the_target_loads_after_vllm_registered_its_config_classes():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("auto:", "ddtree:"))]
    # The premise: vLLM 0.25's registered config classes break a plain transformers load of this target (0.33's no
    # longer do); ddtree's loader must work either way.
    if vllm_below((0, 26, 0)):
        assert lines[0].startswith("auto: failed:") and "vocab_size" in lines[0]
    assert lines[1].startswith("ddtree: Qwen3_5ForCausalLM ")
