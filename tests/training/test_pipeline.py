"""The whole command at tiny scale on CPU: phases run, outputs fit the device tool's limits, resume works."""

import json
import os
import tarfile

from ddtree.training import card, pipeline


def test_run_tiny_end_to_end(tiny_data, tmp_path):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    argv = [
        "run",
        "--data",
        tiny_data.directory,
        "--out",
        out,
        "--work",
        work,
        "--tiny",
        "--device",
        "cpu",
        "--target-steps",
        "4",
        "--target-batch",
        "2",
        "--target-seq",
        "48",
        "--generate",
        "2",
        "--generate-batch",
        "2",
        "--drafter-steps",
        "3",
        "--drafter-batch",
        "2",
        "--drafter-seq",
        "80",
        "--anchors",
        "4",
        "--eval-prompts",
        "1",
        "--eval-tokens",
        "6",
        "--eval-threads",
        "1",
        "--generate-prompt",
        "8",
        "--generate-new",
        "40",
        "--drafter-labels",
        "target",
        "--drafter-snapshots",
        "0.34",
        "0.67",
        "--drafter-layers",
        "2",
    ]
    metrics = pipeline.run(pipeline.build_parser().parse_args(argv))
    assert metrics["target"]["steps"] == 4 and metrics["drafter"]["steps"] == 3
    assert metrics["drafter"]["layers"] == 2  # the tiny shapes' 1, overridden
    # the drafter phase reports the engine-equivalent chain tau on the held-out prompts, not only the
    # mean over the anchors of its training batches
    assert metrics["drafter"]["heldout_chain_tau"] >= 1.0 and metrics["drafter"]["heldout_chain_steps"] >= 1
    # short continuations: drafter rows are cut to their length (raw windows too)
    assert metrics["drafter"]["generated_shape"] == [2, 48] and metrics["drafter"]["seq_len"] == 48
    assert metrics["drafter"]["labels"] == "target"
    # drafters of increasing strength from one run: after 1 and 2 of the 3 steps
    assert metrics["drafter"]["snapshots"] == ["drafter-34", "drafter-67"]
    assert "error" not in metrics["eval"], metrics["eval"].get("error")
    assert set(metrics["eval"]["modes"]) == {"chain"} | {f"ddtree-{b}" for b in card.BUDGETS}
    assert all(m["lossless"] for m in metrics["eval"]["modes"].values())
    # without a GPU only the bf16-vs-fp32 count is missing
    assert card.missing_fields(metrics) == ["eval.gpu_bf16.prompts_agreeing_128"]
    files = sorted(os.listdir(out))
    assert files == ["MODEL_CARD.md", "metrics.json", "models.tar.00", "train.log"]
    assert all(os.path.getsize(os.path.join(out, f)) <= pipeline.PART_BYTES for f in files)
    with tarfile.open(os.path.join(out, "models.tar.00")) as tar:
        names = set(tar.getnames())
        weights = {d: tar.extractfile(f"{d}/model.safetensors").read() for d in ("drafter-34", "drafter-67", "drafter")}
    assert len(set(weights.values())) == 3  # three different drafters
    assert {
        "README.md",
        "target/config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "drafter/config.json",
        "drafter/model.safetensors",
        "drafter-34/model.safetensors",
        "drafter-67/config.json",
    } <= names
    with open(os.path.join(out, "metrics.json")) as handle:
        assert json.load(handle)["eval"]["modes"]["chain"]["tau"] >= 1.0

    # resume: finished phases are skipped, evaluation and outputs are redone
    again = pipeline.run(pipeline.build_parser().parse_args(argv + ["--resume"]))
    assert again["target"]["steps"] == 4 and again["eval"]["reference_outputs"] == metrics["eval"]["reference_outputs"]


def test_drafter_layers_out_of_range_are_refused_with_the_range(tiny_data, tmp_path):
    import pytest

    argv = ["run", "--data", tiny_data.directory, "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    with pytest.raises(SystemExit, match=r"--drafter-layers must be in 1\.\.16, got 0"):
        pipeline.run(pipeline.build_parser().parse_args(argv + ["--tiny", "--device", "cpu", "--drafter-layers", "0"]))
