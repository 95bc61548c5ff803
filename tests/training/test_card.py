"""The model card reports every required number, and says which are missing."""

import copy

from ddtree.training import card


def full_metrics():
    modes = {"chain": {"tau": 2.75, "steps": 50, "lossless": True}}
    for i, b in enumerate(card.BUDGETS):
        modes[f"ddtree-{b}"] = {
            "tau": 3.0 + 0.1 * i,
            "ratio_to_chain": (3.0 + 0.1 * i) / 2.75,
            "steps": 40,
            "lossless": True,
        }
    return {
        "command": "python -m ddtree.training run",
        "seed": 0,
        "device": "cuda",
        "data": {
            "source": "/stdlib",
            "files": {"train": 1787, "heldout": 67},
            "tokens": {"train": 9178084, "heldout": 407707},
            "vocab_size": 4096,
        },
        "target": {
            "steps": 2400,
            "final_loss": 1.2345,
            "first_loss": 8.1,
            "parameters": 10515376,
            "heldout": {"loss": 1.5678, "perplexity": 4.7965, "tokens": 400000},
        },
        "drafter": {"steps": 1500, "final_loss": 2.4681, "parameters": 2164480, "final_tf_tau": 3.3},
        "eval": {
            "prompts": 16,
            "new_tokens": 128,
            "modes": modes,
            "gpu_bf16": {"prompts_agreeing_128": 13, "prompts": 16, "common_prefix": [128] * 16},
        },
    }


def test_card_has_every_required_number():
    metrics = full_metrics()
    assert card.missing_fields(metrics) == []
    text = card.render(metrics)
    for needle in (
        "1787",
        "67",
        "9178084",
        "407707",
        "4096",
        "2400",
        "1.234",
        "1.568",
        "4.80",
        "1500",
        "2.468",
        "2.750",
        "13 of 16",
        "met",
    ):
        assert needle in text, needle
    for i, b in enumerate(card.BUDGETS):
        assert f"DDTree budget {b} | {3.0 + 0.1 * i:.3f} | {(3.0 + 0.1 * i) / 2.75:.3f}" in text
    assert "## Missing numbers" not in text
    # optional entries (skipped modes, errors) are left out when absent, not flagged MISSING
    assert "Evaluation error" not in text and "Evaluation skipped" not in text and "Skipped:" not in text


def test_card_lists_files_skips_and_errors_when_present():
    metrics = full_metrics()
    metrics["files"] = {"target": {"model.safetensors": 21044256}, "drafter": {"config.json": 1297}}
    metrics["eval"]["skipped"] = ["ddtree-256"]
    metrics["eval"]["error"] = "RuntimeError('boom')"
    text = card.render(metrics)
    assert "- `target/model.safetensors`: 21,044,256 bytes" in text and "- `drafter/config.json`: 1,297 bytes" in text
    assert "Evaluation skipped (time box): ddtree-256." in text and "Evaluation error: RuntimeError('boom')." in text


def test_card_checks_the_runs_own_goal():
    metrics = copy.deepcopy(full_metrics())
    metrics["eval"]["modes"]["chain"]["tau"] = 4.26
    assert "Goal chain tau >= 2.5: **met**." in card.render(metrics)
    metrics["goal_chain_tau"] = 4.5
    assert "Goal chain tau >= 4.5: **NOT met**." in card.render(metrics)


def test_card_flags_missing_numbers_and_unmet_goal():
    metrics = copy.deepcopy(full_metrics())
    del metrics["eval"]["modes"]["ddtree-64"]
    metrics["eval"]["modes"]["chain"]["tau"] = 2.0
    missing = card.missing_fields(metrics)
    assert missing == ["eval.modes.ddtree-64.tau", "eval.modes.ddtree-64.ratio_to_chain"]
    text = card.render(metrics)
    assert "NOT met" in text and "## Missing numbers" in text and "eval.modes.ddtree-64.tau" in text
