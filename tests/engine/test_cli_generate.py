"""``ddtree generate`` end to end on tiny checkpoints written to disk."""

import re
from pathlib import Path

import pytest

from ddtree.cli import main
from ddtree.engine import DFlashDraftModel
from ddtree.engine.tiny import tiny_target


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny hybrid target (with a word-level tokenizer) and a drafter, saved like real checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("ckpt")
    target = tiny_target("qwen3_5", seed=4)
    target.save_pretrained(root / "target")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(root / "target")
    DFlashDraftModel.random(target.config, block_size=4).save_pretrained(root / "drafter")
    return root


def generated_ids(out: str):
    return [line for line in out.splitlines() if line and not line.startswith(("===", "---"))]


def test_generate_modes_agree_greedy_and_print_stats(checkpoints, capsys):
    texts = {}
    for mode in ("ar", "chain", "ddtree"):
        args = [
            "generate",
            "--target",
            str(checkpoints / "target"),
            "--drafter",
            str(checkpoints / "drafter"),
            "--prompt",
            "w3 w17 w42 w8",
            "--prompt-ids",
            "5,6",
            "--mode",
            mode,
            "--budget",
            "16",
            "--max-new-tokens",
            "12",
            "--no-progress",
        ]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert out.count("=== request") == 2
        assert re.search(rf"--- {mode}: prompt 4 tok, generated 12 tok in \d+ steps, tau [\d.]+", out)
        texts[mode] = generated_ids(out)
    assert texts["ar"] == texts["chain"] == texts["ddtree"]
    assert all(word.startswith("w") for word in texts["ar"][0].split())


def test_generate_samples_with_seed(checkpoints, capsys):
    args = [
        "generate",
        "--target",
        str(checkpoints / "target"),
        "--drafter",
        str(checkpoints / "drafter"),
        "--prompt-ids",
        "1,2,3",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--max-new-tokens",
        "6",
        "--no-progress",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out.split("--- ")[0] == first.split("--- ")[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budget", "-1"], "--budget must be >= 0"),
        (["--mode", "chain"], "needs a drafter"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", ",".join(["1"] * 600)], "prompts must be shorter than 512"),
        (["--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_generate_reports_bad_input(checkpoints, capsys, extra, message):
    args = ["generate", "--target", str(checkpoints / "target"), "--mode", "ar", "--no-progress"]
    if "--prompt-ids" not in extra:
        args += ["--prompt-ids", "1,2"]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_generate_without_a_tokenizer_asks_for_ids(tmp_path, capsys):
    tiny_target("qwen3").save_pretrained(tmp_path)
    assert main(["generate", "--target", str(tmp_path), "--mode", "ar", "--prompt", "hello"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_progress_bar_draws_and_finishes():
    import io

    from ddtree.engine.progress import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(10, label="ddtree", stream=stream, width=10)
    bar.update(4)
    bar.update(6)
    bar.close()
    assert stream.getvalue().rstrip().split("\r")[-1].startswith("ddtree [##########] 10/10")


PAIR = str(Path(__file__).resolve().parents[1] / "fixtures" / "models")
WORDS = r"[a-z]{1,8}( [a-z]{1,8}){2,4}\."


def _pair_generate(extra):
    pytest.importorskip("xgrammar")
    args = ["generate", "--target", f"{PAIR}/target", "--drafter", f"{PAIR}/drafter", "--dtype", "float32"]
    return main(args + ["--prompt", "# user:\nname the function\n# assistant:\n", "--no-progress"] + extra)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_generate_under_a_regex_prints_text_of_that_regex(capsys, mode):
    assert _pair_generate(["--mode", mode, "--budget", "63", "--regex", WORDS, "--max-new-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "=== request 0 (stop) ===" in out  # ended by the grammar's stop token, not by the token limit
    text = out.split("===\n", 1)[1].split("\n--- ")[0].removesuffix("<|endoftext|>")
    assert re.fullmatch(WORDS, text), text


def test_generate_under_a_json_schema_prints_that_json(capsys):
    import json

    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    assert _pair_generate(["--json-schema", schema, "--max-new-tokens", "40", "--budget", "15"]) == 0
    text = capsys.readouterr().out.split("===\n", 1)[1].split("\n--- ")[0].removesuffix("<|endoftext|>")
    assert set(json.loads(text)) == {"n"}, text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--regex", "[a-z"], "--regex: xgrammar cannot compile '[a-z'"),
        (["--json-schema", "{not json"], "--json-schema: xgrammar cannot compile"),
    ],
)
def test_generate_reports_a_grammar_xgrammar_cannot_compile(capsys, extra, message):
    assert _pair_generate(["--mode", "ar"] + extra) == 2
    assert message in capsys.readouterr().err
